"""One torch thread, as for the training loops' tests: the per-sample checks compare modes
bit for bit or at float tolerance, which holds for equal thread counts."""

from __future__ import annotations

from torch_threads import _one_torch_thread  # noqa: F401  (tests/ is on sys.path)
