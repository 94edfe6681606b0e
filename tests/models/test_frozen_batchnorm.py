"""`model.batchnorm: freeze`: BatchNorm keeps its public statistics through DP training."""

from __future__ import annotations

import pytest
import torch
from opacus.validators import ModuleValidator
from torch import nn
from torch.utils.data import TensorDataset

from dpadapter.algorithms import DPRunSpec
from dpadapter.models.batchnorm import FrozenBatchNorm, freeze_batchnorm
from dpadapter.train.dp_fit import FitSettings, dp_fit

BN_KEYS = {"weight", "bias", "running_mean", "running_var", "num_batches_tracked"}


class BNNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        return self.head(torch.relu(self.bn(self.conv(x))).mean((2, 3)))

    def get_classifier(self):
        return self.head

    def reset_classifier(self, n):
        self.head = nn.Linear(4, n)


def _pretrained(dtype=torch.float32) -> BNNet:
    """Non-private pre-training stand-in: statistics and affine moved away from their init."""
    torch.manual_seed(0)
    m = BNNet().to(dtype)
    m.train()
    with torch.no_grad():
        for _ in range(3):
            m(torch.randn(16, 1, 6, 6, dtype=dtype) * 2 + 1)
        m.bn.weight.uniform_(0.5, 1.5)
        m.bn.bias.uniform_(-0.5, 0.5)
    return m


@pytest.mark.parametrize("affine", ["train", "freeze"])
def test_frozen_bn_is_eval_bn_with_batchnorm_names(affine):
    m = _pretrained(torch.float64)
    x = torch.randn(5, 1, 6, 6, dtype=torch.float64)
    m.eval()
    want = m(x)
    bn_state = {k: v.clone() for k, v in m.state_dict().items()}
    assert freeze_batchnorm(m, affine) == ["bn"]
    assert isinstance(m.bn, FrozenBatchNorm) and not isinstance(m.bn, nn.BatchNorm2d)
    m.train()  # train mode changes nothing: statistics are never batch statistics
    torch.testing.assert_close(m(x), want, rtol=0, atol=1e-12)
    state = m.state_dict()
    assert {k.split(".", 1)[1] for k in state if k.startswith("bn.")} == BN_KEYS
    assert all(torch.equal(state[k], bn_state[k]) for k in bn_state)
    # a BatchNorm checkpoint loads into it, and its state loads back into a BatchNorm
    m.load_state_dict(bn_state)
    fresh = BNNet().to(torch.double)
    fresh.load_state_dict(state)
    fresh.eval()
    torch.testing.assert_close(fresh(x), want, rtol=0, atol=1e-12)
    assert ModuleValidator.validate(m, strict=False) == []
    trainable = {n for n, _ in m.named_parameters()}
    assert ("bn.affine.weight" in trainable) == (affine == "train")


def _fit(model, affine, mode="functorch"):
    torch.manual_seed(1)
    x = torch.randn(64, 1, 6, 6)
    y = torch.randint(0, 3, (64,))
    spec = DPRunSpec(
        target_epsilon=8.0,
        delta=1e-5,
        sample_rate=0.25,
        steps_per_epoch=4,
        epochs=1,
        expected_batch_size=16,
        max_grad_norm=1.0,
    )
    settings = FitSettings(
        lr=0.5,
        momentum=0.0,
        grad_sample_mode=mode,
        physical_batch_size=None,
        pad_batches=False,
        device="cpu",
        tf32=False,
        bn_affine=affine,
    )
    algo, ledger = dp_fit(model, TensorDataset(x, y), "dpsgd", spec, settings, seed=0)
    return ledger


@pytest.mark.parametrize("affine,mode", [("train", "functorch"), ("freeze", "ew"), ("train", "bk")])
def test_dp_fit_never_updates_running_statistics(affine, mode):
    m = _pretrained()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    ledger = _fit(m, affine, mode)
    assert ledger.steps == 4
    after = m.state_dict()
    for k in ("bn.running_mean", "bn.running_var", "bn.num_batches_tracked"):
        assert torch.equal(after[k], before[k]), k
    moved = {k for k in before if not torch.equal(after[k], before[k])}
    # the conv and head always train; the BN scale and shift iff bn_affine is train
    assert {"conv.weight", "head.weight"} <= moved
    assert ({"bn.weight", "bn.bias"} <= moved) == (affine == "train")
    assert not ({"bn.weight", "bn.bias"} & moved) or affine == "train"
