"""No module mixes the examples of a batch or learns from them under DP training (issue 35,
item 1), whatever its type and whether or not its parameters are trained.

Each family is tried in the setting the issue measured: inside a small conv net, with its own
parameters frozen (head tuning, BiTFiT, a norm without affine) or trained, wrapped for DP the
way every training path wraps (`wrap_for_dp`). What each must get: its statistics frozen
(pinned to eval, reported), refused by name, or passed untouched. And what matters: after
wrapping, no example's per-example gradient moves when another example changes, and no buffer
changes in a training step.
"""

from __future__ import annotations

import pytest
import torch
from timm.layers import BatchNormAct2d, EvoNorm2dB0, EvoNorm2dB1, EvoNorm2dS0
from torch import nn

from dpadapter.models.batchnorm import freeze_batchnorm
from dpadapter.per_sample import MixedExamplesError, wrap_for_dp

SAMPLE = ((1, 6, 6), torch.float32)


class BatchMean(nn.Module):
    """Parameter-free, buffer-free, and mixes: subtracts the batch mean."""

    def forward(self, x):
        return x - x.mean(0, keepdim=True)


class InputTracker(nn.Module):
    """Per-example output, but learns from the data: keeps the inputs' mean in a buffer."""

    def __init__(self):
        super().__init__()
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x):
        self.seen += x.detach().mean()
        return x


class EvalMixer(nn.Module):
    """Has a buffer, but mixes in eval mode too: pinning cannot help, so it is refused."""

    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.ones(()))

    def forward(self, x):
        return x * self.scale - x.mean(0, keepdim=True)


# (label, factory, what it must get)
FAMILIES = [
    ("BatchNorm2d", lambda: nn.BatchNorm2d(4), "frozen"),
    ("BatchNorm2d-no-affine", lambda: nn.BatchNorm2d(4, affine=False), "frozen"),
    ("BatchNorm2d-no-stats", lambda: nn.BatchNorm2d(4, track_running_stats=False), "refused"),
    ("BatchNormAct2d", lambda: BatchNormAct2d(4), "frozen"),
    ("InstanceNorm2d-running", lambda: nn.InstanceNorm2d(4, track_running_stats=True), "frozen"),
    ("InstanceNorm2d", lambda: nn.InstanceNorm2d(4, affine=True), "passes"),
    ("EvoNorm2dB0", lambda: EvoNorm2dB0(4), "frozen"),
    ("EvoNorm2dB1", lambda: EvoNorm2dB1(4), "frozen"),
    ("EvoNorm2dS0", lambda: EvoNorm2dS0(4, group_size=2), "passes"),
    ("GroupNorm", lambda: nn.GroupNorm(2, 4), "passes"),
    ("LayerNorm", lambda: nn.LayerNorm([4, 4, 4]), "passes"),
    ("BatchMean", BatchMean, "refused"),
    ("InputTracker", InputTracker, "refused"),
    ("EvalMixer", EvalMixer, "refused"),
]


def _net(norm: nn.Module, train_norm: bool) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3), norm, nn.Flatten(), nn.Linear(64, 3))
    with torch.no_grad():  # non-private pre-training stand-in: statistics off their init
        model.train()
        model(torch.randn(8, 1, 6, 6) * 2 + 1)
    for p in norm.parameters():
        p.requires_grad_(train_norm)
    return model


def _per_example_norms(model: nn.Module, wrapped: nn.Module, x, y) -> torch.Tensor:
    wrapped.train()
    nn.functional.cross_entropy(wrapped(x), y).backward()
    params = [p for p in model.parameters() if p.requires_grad]
    norms = wrapped.per_sample_norms(params)
    wrapped.clear()
    for p in model.parameters():
        p.grad = None
    return norms


# each family with its norm frozen, and trained where it has parameters to train (a combination
# that does not exist is not generated, rather than skipped)
FAMILY_RUNS = [
    pytest.param(
        label, factory, outcome, train, id=f"{label}-norm-{'trained' if train else 'frozen'}"
    )
    for label, factory, outcome in FAMILIES
    for train in (False, True)
    if not train or any(True for _ in factory().parameters())
]


@pytest.mark.parametrize("label,factory,outcome,train_norm", FAMILY_RUNS)
def test_each_family_is_frozen_refused_or_passes_and_never_mixes(
    label, factory, outcome, train_norm
):
    norm = factory()
    kind = type(norm).__name__
    model = _net(norm, train_norm)
    if outcome == "refused":
        with pytest.raises(MixedExamplesError, match=rf"'1' \({kind}\)"):
            wrap_for_dp(model, "bk", sample=SAMPLE)
        return
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    wrapped = wrap_for_dp(model, "bk", sample=SAMPLE)
    frozen = wrapped.independence.frozen
    assert frozen == ((f"'1' ({kind})",) if outcome == "frozen" else ())
    # the measurement: change example 4 only; every other example's norm stays put
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(5, 1, 6, 6, generator=g), torch.tensor([0, 1, 2, 0, 1])
    before = _per_example_norms(model, wrapped, x, y)
    x2 = x.clone()
    x2[3] = x2[3] * 5 + 3
    after = _per_example_norms(model, wrapped, x2, y)
    keep = torch.arange(5) != 3
    torch.testing.assert_close(after[keep], before[keep], rtol=1e-6, atol=0)
    # and nothing was learnt outside the accounting
    for k, v in model.named_buffers():
        assert torch.equal(v, buffers[k]), k


@pytest.mark.parametrize("mode", ["hooks", "functorch", "ew"])
def test_every_mode_refuses_a_mixing_module_and_freezes_statistics(mode):
    with pytest.raises(MixedExamplesError, match=r"'1' \(BatchMean\)"):
        wrap_for_dp(_net(BatchMean(), False), mode, sample=SAMPLE)
    model = _net(nn.InstanceNorm2d(4, track_running_stats=True), False)
    wrapped = wrap_for_dp(model, mode, sample=SAMPLE)
    assert wrapped.independence.frozen == ("'1' (InstanceNorm2d)",)
    running = model[1].running_var.clone()
    wrapped.train()
    nn.functional.cross_entropy(wrapped(torch.randn(4, 1, 6, 6)), torch.zeros(4).long()).backward()
    assert torch.equal(model[1].running_var, running)


def test_without_a_sample_shape_the_first_forward_checks():
    """A path that wraps without the data's shape is checked on its first batch, before it."""
    model = _net(BatchMean(), False)
    wrapped = wrap_for_dp(model, "bk")
    assert wrapped.independence is None
    with pytest.raises(MixedExamplesError, match="BatchMean"):
        wrapped(torch.randn(4, 1, 6, 6))
    model = _net(EvoNorm2dB0(4), False)
    wrapped = wrap_for_dp(model, "bk")
    wrapped(torch.randn(4, 1, 6, 6))
    assert wrapped.independence.frozen == ("'1' (EvoNorm2dB0)",)


def test_frozen_batchnorm_passes_and_is_reported():
    model = _net(BatchNormAct2d(4), True)
    assert freeze_batchnorm(model) == ["1"]
    wrapped = wrap_for_dp(model, "bk", sample=SAMPLE)
    assert wrapped.independence.frozen == ("'1' (BatchNormAct2d)",)
    assert wrapped.independence.pinned == ()


def test_the_check_leaves_an_independent_model_and_the_rng_untouched():
    model = _net(nn.GroupNorm(2, 4), True)
    model[0].eval()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    modes = [m.training for m in model.modules()]
    torch.manual_seed(3)
    rng = torch.get_rng_state()
    wrapped = wrap_for_dp(model, "bk", sample=SAMPLE, check=False)
    assert torch.equal(torch.get_rng_state(), rng)
    assert [m.training for m in model.modules()] == modes
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert wrapped.independence.frozen == ()
    # a switched-off self-test is recorded as unverified, never as a blank
    assert wrapped.per_sample_check["verified"] is False
    assert "unverified" in wrapped.per_sample_check["note"]


_FLAGS_SEEN: list[tuple[bool, bool]] = []  # outside the module: the check restores its state


class FlagRecorder(nn.Module):
    """Per-example; records the cuDNN flags each of its calls ran under."""

    def forward(self, x):
        _FLAGS_SEEN.append((torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark))
        return x


class DetachedMean(nn.Module):
    """Mixes in its forward only: its gradients are per-example, its outputs are not."""

    def forward(self, x):
        return x + x.detach().mean(0, keepdim=True)


def test_the_check_runs_on_deterministic_kernels_and_restores_the_flags(monkeypatch):
    # autotuned cuDNN picks atomic-adding kernels whose sums differ in the last bits between
    # two runs of one batch: the bit-for-bit comparison needs deterministic ones (a GPU-only
    # refusal of GNResNet-10 on an H200, 2026-11-28); the job's own settings come back after
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", False)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", True)
    _FLAGS_SEEN.clear()
    model = nn.Sequential(nn.Conv2d(1, 4, 3), FlagRecorder(), nn.Flatten(), nn.Linear(64, 3))
    wrap_for_dp(model, "bk", sample=SAMPLE, check=False)
    assert _FLAGS_SEEN and set(_FLAGS_SEEN) == {(True, False)}
    assert (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark) == (False, True)


def test_a_refusal_says_how_far_the_other_examples_moved():
    model = nn.Sequential(nn.Conv2d(1, 4, 3), DetachedMean(), nn.Flatten(), nn.Linear(64, 3))
    moved = r"output for one example changes.* by \d\.\de[+-]\d\d of its scale"
    with pytest.raises(MixedExamplesError, match=moved):
        wrap_for_dp(model, "bk", sample=SAMPLE, check=False)


class Net(nn.Module):
    """A conv body with a norm and a linear head (what head tuning trains)."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Conv2d(1, 4, 3), norm, nn.Flatten())
        self.head = nn.Linear(64, 3)

    def forward(self, x):
        return self.head(self.body(x))

    def get_classifier(self):
        return self.head


def _head_tuning(model: nn.Module, check: bool = True):
    """The issue's setting: DP head tuning (every norm parameter frozen) through dp_fit."""
    from torch.utils.data import TensorDataset

    from dpadapter.algorithms import DPRunSpec
    from dpadapter.train.dp_fit import FitSettings, dp_fit
    from dpadapter.train.strategies import get_strategy

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 1, 6, 6, generator=g), torch.randint(0, 3, (64,)))
    spec = DPRunSpec(
        target_epsilon=8.0,
        delta=1e-5,
        sample_rate=0.25,
        steps_per_epoch=4,
        epochs=1,
        expected_batch_size=16,
        max_grad_norm=1.0,
    )
    settings = FitSettings(0.5, 0.0, "bk", None, False, "cpu", False, per_sample_check=check)
    schedule = get_strategy("ht").schedule(4)
    return dp_fit(model, data, "dpsgd", spec, settings, 0, schedule=schedule)


@pytest.mark.slow  # in-process, too long for `make check`
def test_dp_head_tuning_freezes_evonorm_statistics_end_to_end():
    model = Net(EvoNorm2dB0(4))
    with torch.no_grad():  # pre-trained statistics
        model.train()
        model(torch.randn(8, 1, 6, 6) * 2 + 1)
    running = model.body[1].running_var.clone()
    head = model.head.weight.detach().clone()
    algo, ledger = _head_tuning(model)
    assert ledger.steps == 4 and not torch.equal(model.head.weight, head)  # it trained
    assert torch.equal(model.body[1].running_var, running)  # learnt nothing from the batch
    assert algo.frozen_statistics == ["'body.1' (EvoNorm2dB0)"]  # what metrics.json records


@pytest.mark.slow  # over ~1.5 s: make check's 2 minutes (docs/testing.md)
@pytest.mark.parametrize("check", [True, False], ids=["self-test", "no-self-test"])
def test_dp_head_tuning_refuses_a_module_that_mixes_examples(check):
    """By name, whether or not the (optional) self-test runs."""
    with pytest.raises(MixedExamplesError, match=r"'body.1' \(BatchMean\)"):
        _head_tuning(Net(BatchMean()), check)
