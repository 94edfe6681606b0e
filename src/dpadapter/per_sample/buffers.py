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
    memory_format: torch.memory_format = torch.contiguous_format,
    zeroed: bool = False,
) -> torch.Tensor:
    """An (n, ...) tensor from a buffer kept per layout and grown to the largest n.

    Keyed without n: Poisson batches vary in size every step, and one buffer per size would
    keep dozens of them alive. The first n rows of the kept buffer are contiguous (in
    `memory_format`, whose batch dimension is the outermost too). `zeroed`: made zero when
    made, for a caller that writes only part of it every time (the padded input's interior,
    `conv.padded`), so the rest stays zero. Without a `workspace`, a fresh tensor.
    """
    if workspace is None:
        return _new(shape, like, memory_format, zeroed)
    key = (kind, shape[1:], like.dtype, like.device, memory_format, zeroed)
    buf = workspace.get(key)
    if buf is None or buf.shape[0] < shape[0]:
        buf = workspace[key] = _new(shape, like, memory_format, zeroed)
    return buf[: shape[0]]


def _new(shape, like: torch.Tensor, memory_format, zeroed: bool) -> torch.Tensor:
    t = torch.empty(shape, dtype=like.dtype, device=like.device, memory_format=memory_format)
    return t.zero_() if zeroed else t
