"""Book-keeping's arena (`per_sample.arena`): kept per-example gradients side by side, their
norms from one reduction and their sums from one product, in buffers kept between batches."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from dpadapter.per_sample import arena


def _records(n: int, seed: int) -> list[SimpleNamespace]:
    g = torch.Generator().manual_seed(seed)
    shapes = {1: (3, 2), 2: (4,), 3: (2, 2, 2)}
    return [
        SimpleNamespace(kept={pid: torch.randn(n, *shape, generator=g, dtype=torch.float64)})
        for pid, shape in shapes.items()
    ]


def _expected(recs, weights):
    grads = {pid: t for r in recs for pid, t in r.kept.items()}
    flat = torch.cat([t.reshape(len(t), -1) for t in grads.values()], 1)
    sums = {pid: torch.tensordot(weights, t, dims=1) for pid, t in grads.items()}
    return flat.pow(2).sum(1), sums


def _check(arenas, recs_copy, weights):
    want_norms, want_sums = _expected(recs_copy, weights)
    assert len(arenas) == 1
    assert torch.allclose(arenas[0].norms_sq(), want_norms, rtol=1e-13, atol=0)
    got = arenas[0].sums(weights)
    assert set(got) == set(want_sums)
    for pid, want in want_sums.items():
        assert got[pid].shape == want.shape
        assert torch.allclose(got[pid], want, rtol=1e-13, atol=1e-15)


def test_batches_reuse_one_kept_buffer_and_get_their_own_values():
    """Poisson batches of different sizes: one buffer per layout, the values always this
    batch's (a stale row from the bigger batch before would change the norms and sums)."""
    workspace: dict = {}
    ptrs = set()
    for n, seed in ((6, 0), (4, 1), (6, 2)):
        recs = _records(n, seed)
        before = [SimpleNamespace(kept=dict(r.kept)) for r in recs]
        weights = torch.rand(n, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
        arenas = arena.gather(recs, lambda r: 1.0, workspace)
        _check(arenas, before, weights)
        ptrs.add(arenas[0].flat.untyped_storage().data_ptr())
        # every record now holds views into the arena, with its gradients' values
        for r, b in zip(recs, before, strict=True):
            for pid, t in r.kept.items():
                assert t.untyped_storage().data_ptr() in ptrs and torch.equal(t, b.kept[pid])
    assert len(ptrs) == 1  # the largest batch came first: one buffer, its prefix reused
    assert any(k[0] == "arena0" for k in workspace) and any(
        k[0] == "arena-squares" for k in workspace
    )


def test_gathering_records_that_already_hold_arena_views_gives_the_right_arena():
    """Records whose kept gradients are already views into the kept buffer, gathered again in
    another order (the same width, every block moved): copied onto itself, the buffer would
    overwrite blocks before reading them; it is built in a fresh tensor then."""
    workspace: dict = {}
    recs = _records(5, 3)
    arena.gather(recs, lambda r: 1.0, workspace)
    recs = recs[::-1]
    before = [SimpleNamespace(kept={k: v.clone() for k, v in r.kept.items()}) for r in recs]
    weights = torch.rand(5, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    _check(arena.gather(recs, lambda r: 1.0, workspace), before, weights)


def test_without_a_workspace_the_arena_is_a_fresh_tensor():
    recs = _records(3, 5)
    before = [SimpleNamespace(kept=dict(r.kept)) for r in recs]
    weights = torch.rand(3, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    _check(arena.gather(recs, lambda r: 1.0), before, weights)
