"""Book-keeping's ghost norms, alone or a few layers at once (issue 47, fewer kernels).

A ghost norm `|g_i^T a_i|_F^2 = sum_ts (a_t . a_s)(g_t . g_s)` (Li et al. 2022) is two Gram
matrices (T x T per example, for T positions), their product and a sum: four kernels per layer.
Layers whose Grams have the same shape (the same batch and position count: the convolutions of
one ResNet stage, a ViT's linear layers over the same tokens) can write their Grams side by side
into one buffer, and then their products and sums are one kernel each for the group instead of
one each per layer: on GNResNet-10 two groups of three convolutions, eight kernels fewer a step.
Each Gram is the same `bmm` written elsewhere, and the product and the row sums are element-wise
and per row, so every norm is the same bits as alone (checked in `test_bookkeeping.py`).

The groups are sized before the first Gram (`GhostGroups.plan`): a Gram cannot wait for its
group to be known, since the patches it is taken from live in a buffer the next layer of the
same layout reuses (`buffers`). A group's two buffers hold at most `MAX_GROUP_ELEMENTS` values
each, so that grouping never holds much more memory than the largest single Gram (a ViT's
dozens of layers at 197 tokens would otherwise hold them all at once).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from dpadapter.per_sample.buffers import Workspace, buffer

# values in one group's buffer of Grams (each of two; 16 MiB in float32): a layer whose Grams
# alone are larger is a group of one
MAX_GROUP_ELEMENTS = 1 << 22


def ghost(a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """|g_i^T a_i|_F^2 for a (n, T, d), g (n, p, T) via T x T Gram matrices (Li et al. 2022).

    The Grams' inner product stays a product and a sum (two kernels): as one batched dot
    product (a third `bmm`, one kernel) it was 4-290x less exact in float32 (5.6e-7 to 2.8e-5
    relative against 1e-7 to 1.6e-7, T = 16 to 784, 2026-11-28; pinned by
    test_bookkeeping.py), and these norms give the clip factors."""
    return _product_sum(torch.bmm(a, a.transpose(1, 2)), torch.bmm(g.transpose(1, 2), g))


def _product_sum(grams_a: torch.Tensor, grams_g: torch.Tensor) -> torch.Tensor:
    return (grams_a * grams_g).sum(dim=(-2, -1))


# (batch size, positions T, dtype, device): Grams of one key have one shape
Key = tuple[int, int, torch.dtype, torch.device]


@dataclass
class _Group:
    """Up to `size` layers' Grams side by side, (size n, T, T) each; their norms when full."""

    size: int
    grams_a: torch.Tensor
    grams_g: torch.Tensor
    filled: int = 0
    norms: torch.Tensor | None = None  # (size, n), once every member's Grams are in

    def finish(self) -> None:
        n = self.grams_a.shape[0] // self.size
        k = self.filled
        self.norms = _product_sum(self.grams_a[: k * n], self.grams_g[: k * n]).view(k, n)


@dataclass(frozen=True)
class Pending:
    """A ghost norm whose group is not full yet: row `index` of `group.norms`."""

    group: _Group
    index: int


@dataclass
class GhostGroups:
    """The ghost norms of one norms phase, in groups of layers with the same Gram shape."""

    sizes: dict[Key, list[int]]  # per key, its groups' sizes in the order layers come
    workspace: Workspace | None
    _open: dict[Key, _Group] = field(default_factory=dict)
    _made: dict[Key, int] = field(default_factory=dict)  # groups started per key

    @classmethod
    def plan(
        cls, positions: Iterable[tuple[torch.Tensor, int]], workspace: Workspace | None
    ) -> GhostGroups:
        """The groups for the layers whose weight norm is a ghost norm: `positions` gives one
        (input, T) per such layer in the order the norms will be taken."""
        counts: dict[Key, int] = {}
        for a, t in positions:
            key = (a.shape[0], t, a.dtype, a.device)
            counts[key] = counts.get(key, 0) + 1
        sizes = {}
        for key, count in counts.items():
            n, t = key[0], key[1]
            most = max(1, MAX_GROUP_ELEMENTS // (n * t * t))
            sizes[key] = [min(most, count - i) for i in range(0, count, most)]
        return cls(sizes, workspace)

    def norm(self, a: torch.Tensor, g: torch.Tensor) -> torch.Tensor | Pending:
        """`ghost(a, g)` now if its layer is a group of one (or was not planned); else its
        Grams into the group's buffers and a `Pending` row, which `resolve` turns into it."""
        n, t = a.shape[0], a.shape[1]
        key = (n, t, a.dtype, a.device)
        group = self._open.get(key)
        if group is None:
            made = self._made.get(key, 0)
            planned = self.sizes.get(key, [])
            if made >= len(planned) or planned[made] == 1:
                self._made[key] = made + 1
                return ghost(a, g)
            size = planned[made]
            self._made[key] = made + 1
            shape = (size * n, t, t)
            group = _Group(
                size,
                buffer(self.workspace, f"ghost-grams-a{made}", shape, a),
                buffer(self.workspace, f"ghost-grams-g{made}", shape, a),
            )
            self._open[key] = group
        i = group.filled
        rows = slice(i * n, (i + 1) * n)
        torch.bmm(a, a.transpose(1, 2), out=group.grams_a[rows])
        torch.bmm(g.transpose(1, 2), g, out=group.grams_g[rows])
        group.filled += 1
        if group.filled == group.size:
            group.finish()
            del self._open[key]
        return Pending(group, i)

    def resolve(self, parts: list) -> list[torch.Tensor]:
        """`parts` with every `Pending` row replaced by its norm (a group left short, which a
        plan that matched its layers never leaves, is finished over the rows it has)."""
        for group in self._open.values():
            group.finish()
        self._open.clear()
        return [_row(p) if isinstance(p, Pending) else p for p in parts]


def _row(p: Pending) -> torch.Tensor:
    assert p.group.norms is not None
    return p.group.norms[p.index]
