"""Tied weights (`per_sample.shared`): every mode either clips a shared parameter exactly or
refuses the model when it is wrapped, self-test off too.

The reference is float64 torch.func over the model's parameters as `named_parameters` gives them
(a tied parameter once; test_bookkeeping_any_module.reference): each example's gradient of a
shared parameter is the sum over its uses, and its norm is that sum's. The modes
`shared.SUPPORTING_MODES` names must match it to float64 rounding; every other mode must refuse,
naming the parameter and those modes. bk as it was (one use's sum kept, both uses' squared norms
added: 42 % and 34 % off) and the variant that adds the uses' sums but keeps the separate norms
(1.4 % and 3.6 % off, norms 0.94-1.07 of the true ones) both fail here: neither refuses.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from noiseless import dp_sgd  # tests/ is on sys.path
from test_bookkeeping_any_module import _clipped, reference  # float64 torch.func
from torch import nn

from dpadapter.per_sample import GRAD_SAMPLE_MODES, wrap_for_dp
from dpadapter.per_sample.bookkeeping import BookKeepingModule
from dpadapter.per_sample.shared import SUPPORTING_MODES, shared_trained

CLASSES = 5
N = 8


class TwoLinear(nn.Module):
    """Two Linear layers sharing one weight (their biases their own)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 6)
        self.b.weight = self.a.weight
        self.head = nn.Linear(6, CLASSES)

    def forward(self, x):
        return self.head(torch.tanh(self.b(torch.tanh(self.a(x)))))


class TiedEmbeddingHead(nn.Module):
    """A language model's tied input and output weights: the head is the embedding's transpose."""

    def __init__(self, vocab: int = CLASSES, d: int = 6):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens):
        return self.head(self.norm(self.emb(tokens)).mean(1))


def _two_linear():
    g = torch.Generator().manual_seed(1)
    return TwoLinear(), torch.randn(N, 6, generator=g, dtype=torch.float64)


def _embedding_head():
    g = torch.Generator().manual_seed(1)
    return TiedEmbeddingHead(), torch.randint(0, CLASSES, (N, 4), generator=g)


CASES = {"two-linear": _two_linear, "embedding-head": _embedding_head}
TIED = {"two-linear": "a.weight", "embedding-head": "emb.weight"}


def _case(name: str):
    torch.manual_seed(0)
    model, x = CASES[name]()
    y = torch.randint(0, CLASSES, (N,), generator=torch.Generator().manual_seed(2))
    return model.double(), x, y


@pytest.mark.parametrize("mode", GRAD_SAMPLE_MODES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_shared_parameter_is_clipped_exactly_or_refused_at_wrap_time(case, mode):
    model, x, y = _case(case)
    assert list(shared_trained(model)) == [TIED[case]]
    ref = reference(model, x, y)
    norms = ref.norm(dim=1)
    c = float(norms.median())
    assert 0 < int((norms > c).sum()) < N  # both branches of the clip
    want = _clipped(ref, c)
    sample = (tuple(x.shape[1:]), x.dtype)
    if mode not in SUPPORTING_MODES:
        # by construction: the self-test is off, nothing has run a batch yet
        with pytest.raises(ValueError, match="tied weights") as refused:
            wrap_for_dp(copy.deepcopy(model), mode, sample=sample, check=False)
        assert repr(TIED[case]) in str(refused.value)
        assert all(m in str(refused.value) for m in SUPPORTING_MODES)
        return
    wrapped = wrap_for_dp(copy.deepcopy(model), mode, sample=sample, check=False)
    opt = dp_sgd(wrapped, c, N)
    F.cross_entropy(wrapped(x), y).backward()
    opt.clip_and_accumulate()
    assert len(opt.params) == len(list(model.parameters()))  # the tied one once
    got = torch.cat([p.summed_grad.reshape(-1) for p in opt.params])
    assert float((got - want).norm() / want.norm()) < 1e-12
    grad_samples = torch.cat([p.grad_sample.reshape(N, -1) for p in opt.params], 1)
    assert float((grad_samples - ref).abs().max() / ref.abs().max()) < 1e-12


@pytest.mark.parametrize("mode", SUPPORTING_MODES)
def test_the_self_test_passes_a_tied_model_in_the_modes_named(mode):
    """The refusal's advice is usable: the modes it names wrap a tied model with the self-test
    on (it once listed the tied parameter under both holders, and Opacus refused the
    optimizer)."""
    for case in sorted(CASES):
        model, x, _ = _case(case)
        dtype = torch.float32 if x.is_floating_point() else x.dtype
        wrapped = wrap_for_dp(model.float(), mode, sample=(tuple(x.shape[1:]), dtype))
        assert wrapped.per_sample_check["passed"] is True, case


class TwiceHeld(nn.Module):
    """One module holding one parameter under two names."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(3))
        self.v = self.w

    def forward(self, x):
        return x * self.w + x.pow(2) * self.v


def test_a_parameter_held_twice_by_one_module_is_refused():
    with pytest.raises(ValueError, match=r"'0\.w' held as 0\.w \(TwiceHeld\), 0\.v \(TwiceHeld\)"):
        BookKeepingModule(nn.Sequential(TwiceHeld(), nn.Linear(3, 3)))


def test_a_frozen_tied_parameter_is_not_refused_until_it_is_unfrozen():
    """Frozen, it is not clipped (bk trains the rest); unfrozen later (a strategy's phase), the
    next forward refuses before anything is recorded."""
    model, x, y = _case("two-linear")
    model.a.weight.requires_grad_(False)
    bk = BookKeepingModule(model)
    F.cross_entropy(bk(x), y).backward()
    model.a.weight.requires_grad_(True)
    with pytest.raises(ValueError, match="'a.weight' held as a.weight"):
        bk(x)
