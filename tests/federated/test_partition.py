"""The Dirichlet split is a partition: every example in exactly one client."""

import pytest
import torch

from dpadapter.federated.partition import dirichlet_partition


@pytest.mark.parametrize("alpha", [0.1, 1.0, 100.0])
def test_dirichlet_split_is_a_partition(alpha):
    labels = torch.arange(1000) % 10
    parts = dirichlet_partition(labels, 7, alpha, seed=3, min_size=5)
    assert len(parts) == 7
    allidx = torch.cat(parts)
    assert allidx.numel() == 1000 and torch.equal(allidx.sort().values, torch.arange(1000))
    assert min(len(p) for p in parts) >= 5
    assert torch.equal(torch.cat(dirichlet_partition(labels, 7, alpha, 3, 5)), allidx)


def test_alpha_controls_label_skew_and_seed_matters():
    labels = torch.arange(2000) % 10

    def skew(parts):  # mean share of a client's most frequent label
        return sum(
            torch.bincount(labels[p], minlength=10).max().item() / len(p) for p in parts
        ) / len(parts)

    non_iid = dirichlet_partition(labels, 10, 0.1, seed=0, min_size=5)
    iid = dirichlet_partition(labels, 10, 1000.0, seed=0, min_size=5)
    assert skew(non_iid) > 0.5 > 0.15 > skew(iid)
    other = dirichlet_partition(labels, 10, 0.1, seed=1, min_size=5)
    assert any(not torch.equal(a, b) for a, b in zip(non_iid, other, strict=True))


def test_impossible_minimum_is_an_error():
    with pytest.raises(ValueError):
        dirichlet_partition(torch.arange(10) % 2, 5, 1.0, seed=0, min_size=3)
