"""Idle OpenMP threads sleep instead of spinning: `OMP_WAIT_POLICY=PASSIVE` unless set.

torch's CPU kernels run on GNU OpenMP. By default (no `OMP_WAIT_POLICY`) a thread that finishes
its share of a parallel region spins for a while before it sleeps, and libgomp shortens that
spin only when a process asks for more threads than it has CPUs. Our jobs share cores by design:
Snakemake runs as many jobs at once as `--cores` allows, each with its rule's threads, and the
test suite runs two workers on two cores. A two-thread job on a two-core machine whose other
core is busy then spins on a core it cannot use: measured on this 2-core machine (vm,
2026-11-28), a tiny fine-tuning job with `DPADAPTER_THREADS=2` beside a busy loop took 15.3 and
16.8 s of user CPU by default against 6.1 and 6.0 s with `PASSIVE`; alone, 6.5 s either way.
The wait policy changes when a thread sleeps, never how work is split, so results are the same
bits (docs/measured.md: `make run` old beside new).

libgomp reads the variable once, when torch loads it, so this must run before torch is
imported: from `dpadapter/__init__.py`, which imports no torch. A process that imported torch
first keeps what it had; the variable still reaches its child processes (Snakemake's jobs).
A user's own `OMP_WAIT_POLICY` (ACTIVE for a dedicated CPU node, say) is kept.
Hand-written: one environment default.
"""

from __future__ import annotations

import os

VARIABLE = "OMP_WAIT_POLICY"
DEFAULT = "PASSIVE"


def passive_wait_by_default() -> None:
    os.environ.setdefault(VARIABLE, DEFAULT)
