"""Where a training job's seconds go, by phase, recorded in its metrics.json (`timing_s`).

A job's wall time (`wall_time_s`) says how long it took, not what to make faster: a fine-tuning
job of the default grid spends seconds each on its private steps, the per-sample self-test, the
evaluations and the accountant. `bench/cpu/overhead.py` adds the phases up over a finished run, so a
change to any of them is measured on the run it is meant to speed up (docs/measured.md).

Seconds are wall-clock (`time.perf_counter`), nested phases are not subtracted from their
parents (none is nested today), and a phase entered twice adds up. Recording costs two clock
reads per phase; nothing here changes what a job computes.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator


class PhaseClock:
    """Seconds per named phase; `record()` is what metrics.json keeps (rounded to 10 ms)."""

    def __init__(self) -> None:
        self._seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - start)

    def add(self, name: str, seconds: float) -> None:
        self._seconds[name] = self._seconds.get(name, 0.0) + seconds

    def record(self) -> dict[str, float]:
        return {k: round(v, 2) for k, v in self._seconds.items()}


class _NoClock(PhaseClock):
    """What a caller that records nothing passes (HPO trials, the audit, tests)."""

    def add(self, name: str, seconds: float) -> None:
        pass


NO_CLOCK = _NoClock()
