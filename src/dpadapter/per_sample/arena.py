"""Book-keeping's kept per-example gradients in one (n, D) tensor per dtype, device and scale.

Why (issue 47, fewer and larger kernels): a layer whose per-example gradients are small enough
is kept between the norms and the clipped sum (`rules.keep`). Taken one tensor at a time, that
costs a square, a row sum and an addition per parameter tensor for the norms and one matrix
product per tensor for the sum: about 4 kernels per tensor, 38 tensors on GNResNet-10, each
tiny, and at the sizes our users train a GPU pays per launch, not per FLOP. Gathered into one
tensor (one copy), the squared norms of all of them are one square and one row sum, and the
clipped sums one matrix-vector product whose slices are the parameters' sums (views, no copy).

The records keep views into the arena afterwards, so the per-layer tensors are freed; while the
copy runs both exist (the peak grows by the kept gradients' size for that moment).

Grouped by dtype and device (a concatenation would promote one silently) and by the records'
loss scale (`BookKeepingModule._loss_scale`: every record of one batch has the same, but the
sum must weight each example as its own record says).

The same quantities as per tensor, summed in another order: the norms and sums agree with the
per-tensor ones to float rounding, not to the bit (docs/speed.md, docs/validity.md).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from dpadapter.per_sample.buffers import Workspace, buffer


def keep(kept: dict, key: int, grads: torch.Tensor, limit: int) -> torch.Tensor | None:
    """Per-example gradients `grads` (n, ...) kept under `key` for the sum if they have at most
    `limit` elements, their squared norms then left to the arena (None); else their squared
    norms (n,) now, and the sum recomputed later. The one rule for closed forms (`rules`) and
    torch.func's modules (`functional`) alike."""
    if grads.numel() <= limit:
        kept[key] = grads
        return None
    return grads.reshape(grads.shape[0], -1).pow(2).sum(1)


@dataclass
class Arena:
    """One group's kept per-example gradients, flattened side by side."""

    flat: torch.Tensor  # (n, D)
    scale: float  # the loss scale of the records it holds
    slots: dict[int, tuple[int, torch.Size]]  # id(parameter) -> (first column, its shape)
    workspace: Workspace | None = None  # where the squares' buffer is kept (`norms_sq`)

    def norms_sq(self) -> torch.Tensor:
        """(n,) each example's squared norm over every gradient in the arena.

        The squares go into a kept buffer: a fresh one of the arena's size (tens of MB) cost
        its page faults every step on the CPU, 26 against 5 ms for 14 M values (docs/speed.md).
        `linalg.vector_norm` would need no buffer and ran faster still, but was 4e-6 off
        relatively on this CPU, against 1e-7 for these."""
        if self.workspace is None:  # fresh memory either way (a compiled phase: `compiled`)
            return self.flat.pow(2).sum(1)
        sq = buffer(self.workspace, "arena-squares", tuple(self.flat.shape), self.flat)
        return torch.pow(self.flat, 2, out=sq).sum(1)

    def sums(self, weights: torch.Tensor) -> dict[int, torch.Tensor]:
        """`sum_i weights_i * grad_i` for every parameter in the arena, from one product."""
        total = torch.mv(self.flat.t(), weights.to(self.flat.dtype))
        return {
            pid: total[start : start + math.prod(shape)].view(shape)
            for pid, (start, shape) in self.slots.items()
        }


def gather(records: Iterable, scale_of, workspace: Workspace | None = None) -> list[Arena]:
    """The arenas of the records' kept gradients (`rec.kept`); each record then keeps views
    into its arena instead of its own tensors. `scale_of(rec)`: the record's loss scale. With a
    `workspace`, each arena is copied into a buffer kept there (its views are valid until the
    next batch's gather, as the patch buffers are), not into a fresh allocation."""
    groups: dict[tuple, list[tuple[object, int, torch.Tensor]]] = {}
    for rec in records:
        for pid, grads in rec.kept.items():
            key = (grads.dtype, grads.device, scale_of(rec))
            groups.setdefault(key, []).append((rec, pid, grads))
    arenas = []
    for i, ((_, _, scale), entries) in enumerate(groups.items()):
        n = entries[0][2].shape[0]
        rows = [grads.reshape(n, -1) for _, _, grads in entries]
        if len(rows) == 1:
            flat = rows[0]
        elif workspace is None:  # a fresh tensor, which nothing can alias (`_joined`)
            flat = torch.cat(rows, 1)
        else:
            width = sum(r.shape[1] for r in rows)
            flat = _joined(rows, buffer(workspace, f"arena{i}", (n, width), rows[0]))
        slots, start = {}, 0
        for (rec, pid, grads), row in zip(entries, rows, strict=True):
            width = row.shape[1]
            slots[pid] = (start, grads.shape[1:])
            cols = flat[:, start : start + width]
            rec.kept[pid] = cols.unflatten(1, grads.shape[1:]) if grads.dim() > 1 else cols[:, 0]
            start += width
        arenas.append(Arena(flat, scale, slots, workspace))
    return arenas


def _joined(rows: list[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """`rows` side by side in `out`, or in a fresh tensor where one of them is a view of
    `out` (the kept gradients of a record gathered again without being recomputed)."""
    if any(r.untyped_storage().data_ptr() == out.untyped_storage().data_ptr() for r in rows):
        return torch.cat(rows, 1)
    return torch.cat(rows, 1, out=out)
