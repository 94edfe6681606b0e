"""The buffer pool of book-keeping's closed forms: one buffer per tensor layout, reused.

Why: a ghost norm copies a conv's input patches (tens of MB) every step, and the im2col
per-example gradient does the same; a fresh allocation of that size costs its page faults on
the CPU each step (measured 13 ms against 4 ms for a 38 MB copy, docs/speed.md). The pool
(`BookKeepingModule.workspace`) keeps one buffer per layout and hands out its first rows.
"""

from __future__ import annotations

import torch

# (kind, shape without the batch dimension, dtype, device) -> the kept buffer
Workspace = dict[tuple, torch.Tensor]


def buffer(
    workspace: Workspace | None,
    kind: str,
    shape: tuple[int, ...],
    like: torch.Tensor,
) -> torch.Tensor:
    """A contiguous (n, ...) tensor from a buffer kept per layout and grown to the largest n.

    Keyed without n: Poisson batches vary in size every step, and one buffer per size would
    keep dozens of them alive. The first n rows of the kept buffer are contiguous. Without a
    `workspace`, a fresh tensor.
    """
    if workspace is None:
        return like.new_empty(shape)
    key = (kind, shape[1:], like.dtype, like.device)
    buf = workspace.get(key)
    if buf is None or buf.shape[0] < shape[0]:
        buf = workspace[key] = like.new_empty(shape)
    return buf[: shape[0]]
