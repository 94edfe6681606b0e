"""One torch thread for these tests: the models are tiny, and on a shared 2-core machine a
second thread mostly spins waiting for the first (4x the CPU time, measured)."""

from __future__ import annotations

from torch_threads import _one_torch_thread  # noqa: F401  (tests/ is on sys.path)
