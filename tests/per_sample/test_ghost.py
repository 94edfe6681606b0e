"""Ghost norms a few layers at once (per_sample.ghost): the same bits, fewer kernels."""

from __future__ import annotations

import copy

import pytest
import torch
from test_bookkeeping import CASES, LOSS, _data  # tests/per_sample is on sys.path

from dpadapter.per_sample import ghost as ghost_mod
from dpadapter.per_sample import rules
from dpadapter.per_sample.bookkeeping import BookKeepingModule
from dpadapter.per_sample.ghost import GhostGroups, Pending, ghost


def _norms(model, x, y, strategy: str, grouped: bool, monkeypatch) -> tuple[torch.Tensor, list]:
    """bk's per-example norms of one batch, and the ghost groups' sizes that made them."""
    made = []
    plan = rules.ghost_groups

    def groups(records, wanted, s):
        g = plan(records, wanted, s) if grouped else GhostGroups({}, s.workspace)
        made.append(g)
        return g

    monkeypatch.setattr(rules, "ghost_groups", groups)
    bk = BookKeepingModule(copy.deepcopy(model), strategy=strategy)
    params = [p for p in bk.parameters() if p.requires_grad]
    LOSS(bk(x), y).backward()
    norms = bk.per_sample_norms(params)
    return norms, [size for g in made for sizes in g.sizes.values() for size in sizes]


@pytest.mark.slow  # in-process, too long for `make check`
@pytest.mark.parametrize("strategy", ["auto", "ghost"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_grouped_norms_are_each_layers_own_bits(case, strategy, monkeypatch):
    """float32, where a different order of summation would show: every norm is the bits of the
    layer's ghost norm taken alone."""
    model, shape, classes = CASES[case]()
    x, y = _data(shape, classes)
    x = x.float()
    grouped, sizes = _norms(model, x, y, strategy, True, monkeypatch)
    alone, none = _norms(model, x, y, strategy, False, monkeypatch)
    assert none == []
    assert torch.equal(grouped, alone), (grouped - alone).abs().max()
    if strategy == "ghost" and case in ("gnresnet10", "resnet20-gn"):
        assert max(sizes) > 1, sizes  # a stage's convolutions share a Gram shape


def _layers(n=4, t=9, k=3, dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    return [
        (torch.randn(n, t, 5 + i, generator=g, dtype=dtype),
         torch.randn(n, 3 + i, t, generator=g, dtype=dtype))
        for i in range(k)
    ]  # fmt: skip


def test_groups_are_capped_by_their_buffers_size(monkeypatch):
    """Seven layers, at most three per group: groups of 3, 3 and 1 (the last taken alone)."""
    layers = _layers(k=7)
    n, t = layers[0][0].shape[:2]
    monkeypatch.setattr(ghost_mod, "MAX_GROUP_ELEMENTS", 3 * n * t * t + 1)
    groups = GhostGroups.plan([(a, t) for a, _ in layers], {})
    assert list(groups.sizes.values()) == [[3, 3, 1]]
    parts = [groups.norm(a, g) for a, g in layers]
    assert [isinstance(p, Pending) for p in parts] == [True] * 6 + [False]
    for got, (a, g) in zip(groups.resolve(parts), layers, strict=True):
        assert torch.equal(got, ghost(a, g))


def test_a_group_left_short_is_finished_over_its_rows():
    """A plan for more layers than come (which a plan from the same records never makes): the
    norms that came are still right."""
    layers = _layers(k=2)
    groups = GhostGroups.plan([(a, a.shape[1]) for a, _ in layers * 2], {})
    parts = groups.resolve([groups.norm(a, g) for a, g in layers])
    for got, (a, g) in zip(parts, layers, strict=True):
        assert torch.equal(got, ghost(a, g))


def test_poisson_batches_reuse_the_groups_buffers():
    """One buffer per group kept in the workspace across batch sizes (`buffers`)."""
    workspace: dict = {}
    for n in (6, 3, 6):
        layers = _layers(n=n)
        groups = GhostGroups.plan([(a, a.shape[1]) for a, _ in layers], workspace)
        parts = groups.resolve([groups.norm(a, g) for a, g in layers])
        for got, (a, g) in zip(parts, layers, strict=True):
            assert torch.equal(got, ghost(a, g))
    assert len(workspace) == 2 and all(b.shape[0] == 3 * 6 for b in workspace.values())
