"""The memo of the pipeline's repeated calibrations: sigma from a target epsilon.

A grid's jobs repeat the same few calibrations (every upstream method and seed of one task,
epsilon and algorithm alike), and one search costs seconds of PRV evaluations. Results are
memoised under a key that must name every input of the computation (a missing one would hand a
run another run's noise: the tests change each input and expect a miss): in this process's
memory, and in a JSON file shared by the jobs of a results folder (`<results_dir>/.cache/`),
which concurrent jobs update under a lock and replace atomically. An unreadable file is treated
as empty and rewritten. The constant-sigma calibrations are also memoised in this process's
memory across files (the suite's tests each have a results folder of their own), only while the
accountant is the installed code (`sealed`, `genuine`): a test that stubs the accountant neither
writes there nor reads from there.

What it returns only plans a run: anyone who can write the results folder can write any number
here. So no epsilon is ever memoised (each one printed, recorded or checked is the accountant's,
from the history), and every sigma taken from here is verified on the run's planned history,
with no memo, before training (`calibration.verify_plan`).
"""

from __future__ import annotations

import fcntl
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dpadapter.ground import atomic

# this process's results, by file and key (the file's content can only grow by other jobs'
# results under other keys: a key's value never changes)
_MEMORY: dict[tuple[str, str], float] = {}
# results computed without a file, by key, each by the genuine accountant (`sealed`)
_SEALED: dict[str, float] = {}


def cached(cache: str | Path | None, key: str, compute: Callable[[], float]) -> float:
    """`compute()`, memoised under `key` in the JSON file `cache` and in this process's memory
    beside it (None: no memo at all; every call computes)."""
    if cache is None:
        return compute()
    where = (str(Path(cache).resolve()), key)
    if where in _MEMORY:
        return _MEMORY[where]
    stored = _read(Path(cache)).get(key)
    if stored is not None:
        value = float(stored)
    else:
        value = float(compute())
        _write(Path(cache), key, value)
    _MEMORY[where] = value
    return value


def sealed(key: str, compute: Callable[[], float], genuine: Callable[[], bool]) -> float:
    """`compute()`, memoised in this process's memory under `key` while `genuine()` holds, before
    and after computing: only the real accountant's values enter, and a stubbed accountant is
    always called (the suite's tests repeat the same calibrations, one worker after another)."""
    if not genuine():
        return float(compute())
    if key in _SEALED:
        return _SEALED[key]
    value = float(compute())
    if genuine():
        _SEALED[key] = value
    return value


def lookup(cache: str | Path, key: str) -> Any:
    """The value stored under `key` in the JSON file `cache` (any JSON value), or None."""
    return _read(Path(cache)).get(key)


def remember(cache: str | Path, key: str, value: Any) -> None:
    """Store `value` (any JSON value) under `key`, beside what concurrent jobs stored."""
    _write(Path(cache), key, value)


def clear_memory() -> None:
    """Forget this process's results (what another job would start with; tests use it)."""
    _MEMORY.clear()
    _SEALED.clear()


def _read(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
        return {}


def _write(path: Path, key: str, value: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        data = _read(path)
        data[key] = value
        atomic.write_text(path, json.dumps(data, indent=1))
