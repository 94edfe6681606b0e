"""One torch thread: the models are tiny, and a resumed run must match the uninterrupted one
bit for bit, which holds for equal thread counts."""

from __future__ import annotations

from torch_threads import _one_torch_thread  # noqa: F401  (tests/ is on sys.path)
