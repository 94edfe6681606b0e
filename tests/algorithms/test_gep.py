"""GEP: public-only anchor subspace, separate clip/noise of embedding and residual, joint ledger."""

from __future__ import annotations

import math

import algo_harness as H
import pytest
import torch
from torch.utils.data import TensorDataset

from dpadapter.algorithms import ALGORITHMS
from dpadapter.algorithms.gep import power_method, split_groups
from dpadapter.privacy import PrivacyLedger, Segment, epsilon_from_history


def _bases(run) -> list[torch.Tensor]:
    return [v.clone() for v in run.opt.bases]


def test_anchor_subspace_depends_on_public_data_only(algo_data):
    s = H.spec(max_grad_norm=0.5, expected_batch_size=12)
    x, y = algo_data.private.tensors
    a = H.build("gep", s, public=algo_data.public, sigma=1.0)
    b = H.build("gep", s, public=algo_data.public, sigma=1.0)
    H.logical_step(a, x[:12], y[:12])
    H.logical_step(b, x[100:112], y[100:112])
    for va, vb in zip(_bases(a), _bases(b), strict=True):
        assert torch.equal(va, vb)  # other private data, same subspace
        assert torch.allclose(va @ va.T, torch.eye(va.shape[0]), atol=1e-5)  # orthonormal
    px, py = algo_data.public.tensors
    other = TensorDataset(torch.flip(px, dims=[-1]), py)
    c = H.build("gep", s, public=other, sigma=1.0)
    H.logical_step(c, x[:12], y[:12])
    assert not all(torch.allclose(va, vc) for va, vc in zip(_bases(a), _bases(c), strict=True))


def test_needs_public_data_before_the_optimizer():
    cls = ALGORITHMS["gep"]
    assert cls.needs_public_data
    with H.fixed_sigma(cls, 1.0):
        algo = cls(H.spec(), PrivacyLedger(1e-5), torch.Generator())
    with pytest.raises(RuntimeError, match="set_public_data"):
        model = H.tiny_model()
        algo.make_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)


def test_embedding_and_residual_are_clipped_and_noised_separately(algo_data):
    s = H.spec(expected_batch_size=12, params={"embedding_clip": 0.3, "residual_clip": 0.02})
    run = H.build("gep", s, public=algo_data.public, sigma=1.0)
    x, y = algo_data.private.tensors
    H.logical_step(run, x[:12], y[:12])
    emb, res = run.algo.audit[0].releases
    assert (emb.name, emb.sensitivity, res.name, res.sensitivity) == (
        "embedding",
        0.3,
        "residual",
        0.02,
    )
    assert emb.noise_std == pytest.approx(math.sqrt(2) * 0.3) and res.noise_std == pytest.approx(
        math.sqrt(2) * 0.02
    )
    assert run.ledger.history[0].noise_multiplier == pytest.approx(1.0, rel=1e-12)


def test_joint_ledger_versus_the_public_codes_two_releases():
    """q = 0.02, T = 10k, sigma = 2.09 (delta 1e-6, RDP): twice the RDP of separate releases
    gives about 7.97, the joint release on the concatenated vector about 8.61."""
    q, steps, sigma, delta = 0.02, 10_000, 2.09, 1e-6
    separate = epsilon_from_history([Segment(sigma, q, 2 * steps)], delta, "rdp")
    joint = epsilon_from_history([Segment(sigma / math.sqrt(2), q, steps)], delta, "rdp")
    assert separate == pytest.approx(7.97, abs=0.03)
    assert joint == pytest.approx(8.61, abs=0.03)


def test_power_method_finds_the_row_space_of_low_rank_anchors():
    g = torch.Generator().manual_seed(0)
    basis = torch.linalg.qr(torch.randn(50, 3, generator=g))[0].T  # rank-3 row space in R^50
    anchors = torch.randn(20, 3, generator=g) @ basis
    v = power_method(anchors, 3, 1, torch.Generator().manual_seed(1))
    assert torch.allclose(v @ v.T, torch.eye(3), atol=1e-5)
    residual = anchors - (anchors @ v.T) @ v
    assert float(residual.norm()) < 1e-4 * float(anchors.norm())


def test_parameter_groups_are_consecutive_and_cover_everything():
    sizes = [10, 200, 5, 5, 300, 80, 1]
    groups = split_groups(sizes, 3)
    assert [i for g in groups for i in g] == list(range(len(sizes)))
    assert len(groups) == 3
    assert split_groups([4], 3) == [[0]]
