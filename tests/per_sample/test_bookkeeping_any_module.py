"""bk on models with parameters outside its closed forms, against a whole-model torch.func check.

The reference is `vmap(grad(loss_i))` over every trained parameter of the model (independent of
bk's per-module records): per-example norms and Opacus' clipped sum, in float64, with C below
the median norm so that most examples are clipped and some are not.
"""

from __future__ import annotations

import copy

import pytest
import timm
import torch
import torch.nn.functional as F
from noiseless import dp_sgd  # tests/ is on sys.path
from torch import nn
from torch.func import functional_call, grad, vmap

from dpadapter.per_sample import wrap_for_dp
from dpadapter.per_sample.bookkeeping import BookKeepingModule

LOSS = F.cross_entropy
CLASSES = 5


class FrozenStatsNorm(nn.Module):
    """A frozen-statistics BatchNorm that is not an nn.BatchNorm: buffers plus trained affine."""

    def __init__(self, c: int):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(c))
        self.bias = nn.Parameter(0.1 * torch.randn(c))
        self.register_buffer("running_mean", 0.1 * torch.randn(c))
        self.register_buffer("running_var", 1 + 0.1 * torch.rand(c))

    def forward(self, x):
        return F.batch_norm(
            x, self.running_mean, self.running_var, self.weight, self.bias, training=False
        )


class FrozenNormNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3, padding=1, bias=False)
        self.norm = FrozenStatsNorm(6)
        self.conv2 = nn.Conv2d(6, 8, 3, stride=2, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, CLASSES)

    def forward(self, x):
        h = F.relu(self.norm(self.conv(x)), inplace=True)
        h = F.relu(self.bn(self.conv2(h)))
        return self.head(h.mean(dim=(2, 3)))


def _eval_batchnorms(model: nn.Module) -> nn.Module:
    """Every BatchNorm in eval mode (running statistics as from pre-training), made non-trivial."""
    g = torch.Generator().manual_seed(3)
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.eval()
            m.running_mean.copy_(0.1 * torch.randn(m.running_mean.shape, generator=g))
            m.running_var.copy_(1 + 0.2 * torch.rand(m.running_var.shape, generator=g))
            with torch.no_grad():
                m.weight.copy_(1 + 0.1 * torch.randn(m.weight.shape, generator=g))
    return model


def _vit(**kw):
    return timm.create_model(
        "vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2, num_classes=CLASSES, **kw
    )


CASES = {
    "vit": lambda: _vit(),
    "vit-layerscale": lambda: _vit(init_values=1e-5),
    # register tokens, and the position embedding added before the prefix (DeiT-3 layout)
    "vit-reg-noembedclass": lambda: _vit(reg_tokens=2, no_embed_class=True),
    "vit-no-class-token": lambda: _vit(class_token=False, global_pool="avg"),
    # a resampled position embedding: the closed form does not apply, torch.func does
    "vit-dynamic": lambda: _vit(dynamic_img_size=True),
    "convnext": lambda: timm.create_model("convnext_atto", num_classes=CLASSES),
    "resnet-frozen-bn": lambda: _eval_batchnorms(timm.create_model("resnet10t", num_classes=5)),
    "frozen-stats-norm": lambda: _eval_batchnorms(FrozenNormNet()),
}
# modules that must take the torch.func path in each case (by class name)
FALLBACK = {
    "vit": set(),
    "vit-layerscale": {"LayerScale"},
    "vit-reg-noembedclass": set(),
    "vit-no-class-token": set(),
    "vit-dynamic": {"VisionTransformer"},
    "convnext": {"LayerNorm2d", "ConvNeXtBlock"},
    "resnet-frozen-bn": {"BatchNorm2d"},
    "frozen-stats-norm": {"FrozenStatsNorm", "BatchNorm2d"},
}


def reference(model: nn.Module, x, y) -> torch.Tensor:
    """(n, P): each example's gradient over the trained parameters, by torch.func."""
    params = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}

    def loss(p, xi, yi):
        return LOSS(functional_call(model, p, (xi[None],)), yi[None])

    g = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)
    return torch.cat([v.reshape(len(y), -1) for v in g.values()], 1)


def _data(n=6):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 3, 32, 32, generator=g, dtype=torch.float64)
    return x, torch.randint(0, CLASSES, (n,), generator=g)


def _clipped(grads: torch.Tensor, c: float) -> torch.Tensor:
    norms = grads.norm(dim=1)
    return (grads * (c / (norms + 1e-6)).clamp(max=1.0)[:, None]).sum(0)


def _bk_run(model, x, y, c, **kw):
    """Two physical batches through an Opacus DPOptimizer (sigma 0): norms and summed_grad."""
    bk = BookKeepingModule(model, **kw)
    opt = dp_sgd(bk, c, len(y))
    norms = []
    half = len(y) // 2
    for part in (slice(0, half), slice(half, None)):
        LOSS(bk(x[part]), y[part]).backward()
        norms.append(bk.per_sample_norms(opt.params))
        opt.clip_and_accumulate()
    return torch.cat(norms), torch.cat([p.summed_grad.reshape(-1) for p in opt.params]), bk


@pytest.mark.parametrize("case", sorted(CASES))
def test_norms_and_clipped_sum_match_the_torch_func_reference(case):
    torch.manual_seed(0)
    model = CASES[case]().double()
    x, y = _data()
    ref = reference(model, x, y)
    ref_norms = ref.norm(dim=1)
    c = float(ref_norms.median())  # the lower median: half are clipped
    assert 0 < int((ref_norms > c).sum()) < len(y)  # some clipped, some not
    norms, summed, bk = _bk_run(copy.deepcopy(model), x, y, c)
    assert float((norms - ref_norms).abs().max() / ref_norms.max()) < 1e-10
    want = _clipped(ref, c)
    assert float((summed - want).norm() / want.norm()) < 1e-10
    # bk's plan: the named modules took torch.func, Linear/Conv2d kept their closed forms
    plan = bk.last_plan
    kinds = {type(m).__name__: plan.get(n or "<root>") for n, m in bk._module.named_modules()}
    for name in FALLBACK[case]:
        assert kinds[name] == "torch.func", (name, kinds)
    if case.startswith("vit") and "VisionTransformer" not in FALLBACK[case]:
        # the tokens' closed form: no replay of the model (tokens.py)
        assert kinds["VisionTransformer"] == "closed form (tokens)", kinds
    assert kinds["Linear"] != "torch.func" and kinds.get("Conv2d", "x") != "torch.func"


def test_recomputed_fallback_sums_equal_the_kept_ones():
    torch.manual_seed(0)
    model = CASES["vit-layerscale"]().double()
    x, y = _data()
    _, kept, _ = _bk_run(copy.deepcopy(model), x, y, 0.5)
    _, recomputed, _ = _bk_run(copy.deepcopy(model), x, y, 0.5, keep_elements=0)
    assert torch.allclose(kept, recomputed, rtol=1e-10, atol=1e-13)


def test_a_dp_optimizer_step_through_wrap_and_bind_gives_the_reference_sum():
    torch.manual_seed(0)
    model = CASES["frozen-stats-norm"]().double()
    x, y = _data(8)
    ref = reference(model, x, y)
    c = float(ref.norm(dim=1).median())
    wrapped = wrap_for_dp(model, "bk")
    _eval_batchnorms(model)  # wrap leaves modes alone; dp_fit's .train() would be refused
    opt = dp_sgd(wrapped, c, len(y))
    LOSS(wrapped(x), y).backward()
    opt.pre_step()
    got = torch.cat([p.summed_grad.reshape(-1) for p in opt.params])
    want = _clipped(ref, c)
    assert float((got - want).norm() / want.norm()) < 1e-10
    # after the step: no parameter left switched off
    assert all(p.requires_grad for p in model.parameters())


def test_only_the_first_fallback_layer_keeps_autograd_weight_gradients():
    model = CASES["frozen-stats-norm"]().double()
    x, y = _data()
    LOSS(BookKeepingModule(model)(x), y).backward()
    with_grad = [n for n, p in model.named_parameters() if p.grad is not None]
    assert with_grad == ["conv.weight"], with_grad


class Twice(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, x):
        return x * self.scale


class Pair(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(3))

    def forward(self, x):
        return x * self.w, x


class Noisy(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(3))

    def forward(self, x):
        return F.dropout(x * self.w, 0.5, training=self.training)


def test_what_cannot_be_right_is_refused_naming_the_module():
    x, y = torch.randn(4, 3), torch.tensor([0, 1, 2, 0])
    t = Twice()
    with pytest.raises(RuntimeError, match=r"1 \(Twice\) is called twice"):
        BookKeepingModule(nn.Sequential(nn.Linear(3, 3), t, t))(x)
    bn = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    with pytest.raises(ValueError, match=r"1 \(BatchNorm1d in training mode\)"):
        BookKeepingModule(bn)
    bk = BookKeepingModule(bn.eval())
    bn.train()  # switched back later: refused at the next forward
    with pytest.raises(ValueError, match="BatchNorm1d in training mode"):
        bk(x)
    with pytest.raises(RuntimeError, match=r"0 \(Pair\) .* returns tuple, not a tensor"):
        BookKeepingModule(nn.Sequential(Pair()))(x)
    noisy = BookKeepingModule(nn.Sequential(Noisy(), nn.Linear(3, 3)))
    LOSS(noisy(x), y).backward()
    with pytest.raises(RuntimeError, match=r"0 \(Noisy\) draws random numbers"):
        noisy.per_sample_norms(list(noisy.parameters()))


def test_every_registered_model_keeps_the_closed_forms():
    """The pipeline's own models never take torch.func: their bk results stay as they were."""
    from dpadapter.models import MODEL_NAMES, create_model
    from dpadapter.per_sample.bookkeeping import closed_form
    from dpadapter.settings import ModelConfig

    for name in sorted(MODEL_NAMES):
        channels = 3 if name.startswith("resnet") else 1
        model = create_model(ModelConfig(name, 4, 8), 10, channels, seed=0)
        owners = [m for m in model.modules() if any(True for _ in m.parameters(recurse=False))]
        assert owners and all(closed_form(m) for m in owners), name
