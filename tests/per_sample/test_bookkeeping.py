"""Book-keeping clipping against a per-example loop, for every registered model and layer kind.

The reference: one forward/backward per example, each gradient scaled by Opacus' factor
min(1, C / (|g| + 1e-6)), summed. C is the median per-example norm (half the examples are
clipped), the batch is split in two physical batches (accumulation), all in float64 so that only
summation order differs.
"""

from __future__ import annotations

import copy

import pytest
import torch
from noiseless import dp_sgd  # tests/ is on sys.path
from opacus.optimizers import DPOptimizer
from torch import nn

from dpadapter.models import MODEL_NAMES, create_model
from dpadapter.per_sample import conv as conv_mod
from dpadapter.per_sample import dp_optimizer, effective_mode, rules, wrap_for_dp
from dpadapter.per_sample.bookkeeping import BookKeepingModule
from dpadapter.per_sample.conv import per_example_grouped, per_example_im2col
from dpadapter.settings import ModelConfig

LOSS = nn.functional.cross_entropy


class SequenceNet(nn.Module):
    """Linear layers over a sequence (ghost norms over positions) and a LayerNorm."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, 40)
        self.norm = nn.LayerNorm(40)
        self.out = nn.Linear(40, 3)

    def forward(self, x):
        h = torch.relu(self.norm(self.inp(x.reshape(len(x), 4, 6))))
        return self.out(h).mean(1)


class OddConvs(nn.Module):
    """Strided, dilated, grouped and biased convolutions, and an in-place ReLU after one."""

    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(2, 4, 3, stride=2, padding=1, bias=True)
        self.b = nn.Conv2d(4, 8, 3, padding=2, dilation=2, groups=2, bias=True)
        self.gn = nn.GroupNorm(2, 8)
        self.c = nn.Conv2d(8, 8, (1, 3), padding=(0, 1), bias=False)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        h = nn.functional.relu(self.a(x), inplace=True)
        h = self.c(torch.tanh(self.gn(self.b(h))))
        return self.head(h.mean(dim=(2, 3)))


def _registered(name: str) -> tuple[nn.Module, tuple[int, ...], int]:
    shape = (3, 32, 32) if name.startswith("resnet") else (1, 28, 28)
    cfg = ModelConfig(name, 4, 8)
    return create_model(cfg, 10, shape[0], seed=0), shape, 10


CASES = {
    **{name: (lambda n=name: _registered(n)) for name in sorted(MODEL_NAMES)},
    "sequence": lambda: (SequenceNet(), (24,), 3),
    "odd-convs": lambda: (OddConvs(), (2, 9, 9), 3),
}


def reference(model: nn.Module, x, y, c: float | None):
    grads = []
    for i in range(len(y)):
        model.zero_grad(set_to_none=True)
        LOSS(model(x[i : i + 1]), y[i : i + 1]).backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.requires_grad]))
    g = torch.stack(grads)
    norms = g.norm(dim=1)
    c = float(norms.median()) if c is None else c
    return (g * (c / (norms + 1e-6)).clamp(max=1.0)[:, None]).sum(0), c


def bk_sum(model: nn.Module, x, y, c: float, launch_bound=None, **kw) -> torch.Tensor:
    bk = BookKeepingModule(model, **kw)
    bk.launch_bound = launch_bound
    opt = dp_sgd(bk, c, len(y))
    half = len(y) // 2
    for part in (slice(0, half), slice(half, None)):
        LOSS(bk(x[part]), y[part]).backward()
        opt.clip_and_accumulate()
    return torch.cat([p.summed_grad.reshape(-1) for p in opt.params])


def _data(shape, classes, n=8):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, *shape, generator=g, dtype=torch.float64)
    return x, torch.randint(0, classes, (n,), generator=g)


@pytest.mark.parametrize(
    "strategy", ["auto", "auto-launch-bound", "ghost", "ghost-launch-bound", "per-example"]
)
@pytest.mark.parametrize("case", sorted(CASES))
def test_clipped_sum_equals_the_per_example_reference(case, strategy):
    """Every path of the closed forms; "-launch-bound": the choices and one-kernel patches
    (`conv.columns`) of a GPU."""
    model, shape, classes = CASES[case]()
    model = model.double()
    x, y = _data(shape, classes)
    ref, c = reference(copy.deepcopy(model), x, y, None)
    launch_bound = strategy.endswith("-launch-bound") or None
    strategy = strategy.removesuffix("-launch-bound")
    got = bk_sum(copy.deepcopy(model), x, y, c, launch_bound, strategy=strategy)
    err = float((got - ref).norm() / ref.norm())
    assert err < 1e-9, f"{case} ({strategy}): relative error {err:.3g}"


@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA device (CI has none; bench/gpu/gpu_smoke.sh)",
)
@pytest.mark.parametrize("case", sorted(CASES))
def test_clipped_sum_on_cuda_equals_the_cpu_reference(case):
    """The same check on the GPU: cuDNN's kernels, the im2col path and the workspace there."""
    model, shape, classes = CASES[case]()
    model = model.double()
    x, y = _data(shape, classes)
    ref, c = reference(copy.deepcopy(model), x, y, None)
    got = bk_sum(copy.deepcopy(model).cuda(), x.cuda(), y.cuda(), c).cpu()
    err = float((got - ref).norm() / ref.norm())
    assert err < 1e-9, f"{case} on CUDA: relative error {err:.3g}"


CONVS = {  # (in, out, kernel, stride, padding, dilation, groups)
    "stem": (1, 4, 3, 1, 1, 1, 1),
    "rgb-stride": (3, 5, 3, 2, 1, 1, 1),
    "dilated-rect": (2, 3, (2, 3), (1, 2), (2, 0), (2, 1), 1),
    "grouped": (4, 6, 3, 1, 1, 1, 2),
    "depthwise": (4, 4, 3, 1, 2, 2, 4),
    "no-pad-1x1": (6, 2, 1, 1, 0, 1, 1),
}


@pytest.mark.parametrize("kernel", ["im2col", "im2col-one-kernel", "im2col-chunks", "grouped"])
@pytest.mark.parametrize("conv", sorted(CONVS))
def test_per_example_conv_gradients_match_autograd(conv, kernel, monkeypatch):
    """Both per-example kernels against one autograd weight gradient per example;
    "-chunks": the one-kernel patches of two examples at a time (`conv.PATCH_ELEMENTS`)."""
    c_in, c_out, k, stride, pad, dil, groups = CONVS[conv]
    torch.manual_seed(0)
    m = nn.Conv2d(c_in, c_out, k, stride, pad, dil, groups, bias=False).double()
    a = torch.randn(5, c_in, 9, 8, dtype=torch.float64)
    out = m(a)
    g = torch.randn_like(out)
    want = torch.stack(
        [torch.autograd.grad(m(a[i : i + 1]), m.weight, g[i : i + 1])[0] for i in range(5)]
    )
    if kernel == "im2col-chunks":  # one example's patches: c_in * kh * kw * output positions
        per_example = c_in * m.weight[0, 0].numel() * out[0, 0].numel()
        monkeypatch.setattr(conv_mod, "PATCH_ELEMENTS", 2 * per_example)
    workspace: dict = {}
    # Full batch, a smaller one (a prefix of the kept buffer), the full one again (reused).
    for rows in (slice(0, 5), slice(1, 3), slice(0, 5)):
        if kernel.startswith("im2col"):
            one = kernel != "im2col"
            got = per_example_im2col(m, a[rows], g[rows], workspace, one_kernel=one)
        else:
            got = per_example_grouped(m, a[rows], g[rows], m.weight)
        assert got.shape == want[rows].shape
        assert torch.allclose(got, want[rows], rtol=1e-10, atol=1e-12)
    # im2col keeps its patches' buffer, and the zero-bordered padded input's if it pads
    padding = m.padding != (0, 0)
    assert len(workspace) == ((1 + padding) if kernel == "im2col" else 0)  # one kernel: none


@pytest.mark.parametrize("conv", sorted(c for c in CONVS if CONVS[c][-1] == 1))
def test_ghost_norms_from_one_kernel_patches_equal_the_copied_patches(conv):
    """The GPU's patches (`conv.columns`, channel-major columns from one im2col kernel) give
    the ghost norm of the CPU's (`conv.patches`), and both the per-example gradients' norms."""
    c_in, c_out, k, stride, pad, dil, groups = CONVS[conv]
    torch.manual_seed(0)
    m = nn.Conv2d(c_in, c_out, k, stride, pad, dil, groups, bias=False).double()
    a = torch.randn(5, c_in, 9, 8, dtype=torch.float64)
    g = torch.randn_like(m(a))
    g3 = g.reshape(5, c_out, -1)
    copied = rules.ghost(conv_mod.patches(m, a, {}), g3)
    one_kernel = rules.ghost(conv_mod.columns(m, a).transpose(1, 2), g3)
    want = per_example_grouped(m, a, g, m.weight).reshape(5, -1).pow(2).sum(1)
    assert torch.allclose(copied, want, rtol=1e-10, atol=0)
    assert torch.allclose(one_kernel, want, rtol=1e-10, atol=0)


def test_workspace_keeps_one_buffer_per_layer_layout_across_batch_sizes():
    """Poisson batches change size every step: buffers are reused, not kept per size."""
    model, shape, classes = CASES["resnet20-gn"]()
    bk = BookKeepingModule(model)
    params = [p for p in bk.parameters() if p.requires_grad]
    sizes = []
    for n in (6, 4, 9, 5, 9):
        x, y = _data(shape, classes, n=n)
        LOSS(bk(x.float()), y).backward()
        bk.per_sample_norms(params)
        bk.clear()
        sizes.append(len(bk.workspace))
    assert sizes[0] > 0 and len(set(sizes)) == 1, sizes
    assert all(b.shape[0] == 9 for b in bk.workspace.values())


def test_kept_and_recomputed_sums_agree():
    """Per-example gradients kept for the sum or recomputed as one kernel: the same sum."""
    model, shape, classes = CASES["odd-convs"]()
    model = model.double()
    x, y = _data(shape, classes)
    kept = bk_sum(copy.deepcopy(model), x, y, 0.3)
    recomputed = bk_sum(copy.deepcopy(model), x, y, 0.3, keep_elements=0)
    assert torch.allclose(kept, recomputed, rtol=1e-10, atol=1e-13)


def test_head_only_tuning_clips_the_trained_head():
    model, shape, classes = CASES["cnn-gn"]()
    model = model.double()
    for p in model.parameters():
        p.requires_grad_(False)
    for p in model.get_classifier().parameters():
        p.requires_grad_(True)
    x, y = _data(shape, classes)
    ref, c = reference(copy.deepcopy(model), x, y, None)
    got = bk_sum(model, x, y, c)
    assert got.numel() == sum(p.numel() for p in model.get_classifier().parameters())
    assert float((got - ref).norm() / ref.norm()) < 1e-9
    assert [p.requires_grad for p in model.parameters()].count(True) == 2


def test_backward_skips_the_unclipped_weight_gradients_and_restores_requires_grad():
    """The saving: only the first layer (input needs no gradient) gets autograd's p.grad."""
    model, shape, classes = CASES["resnet20-gn"]()
    bk = BookKeepingModule(model)
    x, y = _data(shape, classes)
    LOSS(bk(x.float()), y).backward()
    assert all(p.requires_grad for p in model.parameters())
    with_grad = [n for n, p in model.named_parameters() if p.grad is not None]
    assert with_grad == ["stem.0.weight"], with_grad
    assert len(bk.records) == sum(
        1 for m in model.modules() if any(True for _ in m.parameters(recurse=False))
    )


def test_empty_batch_and_a_missing_backward():
    model, shape, classes = CASES["cnn-gn"]()
    bk = BookKeepingModule(model)
    opt = _noiseless_optimizer(bk, max_grad_norm=1.0)
    for p in opt.params:  # what the algorithms do for an empty Poisson batch
        p.grad_sample = torch.zeros((0, *p.shape))
    opt.clip_and_accumulate()
    assert all(float(p.summed_grad.abs().sum()) == 0 for p in opt.params)
    opt.zero_grad(set_to_none=True)
    x, y = _data(shape, classes, n=4)
    bk(x.float())  # a forward without its backward
    with pytest.raises(RuntimeError, match="before the backward"):
        opt.clip_and_accumulate()


def test_training_mode_batchnorm_is_refused_frozen_ones_allowed():
    """Other layers without closed forms are clipped by torch.func (test_bookkeeping_any_module)."""
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.Flatten(), nn.Linear(8, 2))
    with pytest.raises(ValueError, match="BatchNorm2d in training mode"):
        BookKeepingModule(model)
    model[1].weight.requires_grad_(False)
    model[1].bias.requires_grad_(False)
    bk = BookKeepingModule(model)
    model[1].weight.requires_grad_(True)  # a strategy unfreezing it later is caught too
    with pytest.raises(ValueError, match="BatchNorm2d"):
        bk(torch.zeros((2, 1, 4, 4)))


def test_a_layer_called_twice_after_a_trained_one_is_refused():
    """Its weights are switched off at its first call; the second is caught all the same."""
    lin = nn.Linear(3, 3)
    model = nn.Sequential(nn.Linear(3, 3), lin, nn.ReLU(), lin)
    with pytest.raises(RuntimeError, match="called twice"):
        BookKeepingModule(model)(torch.randn(2, 3))


def test_a_layer_called_twice_is_refused():
    lin = nn.Linear(3, 3)
    model = nn.Sequential(lin, nn.ReLU(), lin)
    with pytest.raises(RuntimeError, match="called twice"):
        BookKeepingModule(model)(torch.randn(2, 3))


def test_algorithms_reading_per_example_gradients_run_hooks():
    assert effective_mode("bk", needs_per_sample_gradients=True) == "hooks"
    assert effective_mode("bk", needs_per_sample_gradients=False) == "bk"
    model, _, _ = CASES["cnn-gn"]()
    assert not isinstance(wrap_for_dp(model, "bk", True), BookKeepingModule)
    with pytest.raises(ValueError, match="unknown grad_sample_mode"):
        effective_mode("ghost", False)


def _tf32_flags() -> tuple[bool, bool]:
    return torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32


@pytest.fixture
def tf32_on():
    """TF32 allowed, as `devices.configure` leaves a CUDA job (the flags are global: CPU too)."""
    before = _tf32_flags()
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def test_clipping_runs_in_full_fp32_and_restores_the_flags(tf32_on, monkeypatch):
    """Norms and clipped sums both see TF32 off; the job's flags come back after the clip."""

    seen: dict[str, tuple[str, bool]] = {}
    for name in ("layer_norms_sq", "layer_sums"):
        real = getattr(rules, name)

        def spy(*a, _real=real, _name=name, **k):
            seen[_name] = _tf32_flags()
            return _real(*a, **k)

        monkeypatch.setattr(rules, name, spy)
    model, shape, classes = CASES["cnn-gn"]()
    x, y = _data(shape, classes)
    got = bk_sum(model, x.float(), y, 0.1)
    assert got.abs().sum() > 0
    assert seen == {
        "layer_norms_sq": (False, False),
        "layer_sums": (False, False),
    }, seen
    assert _tf32_flags() == (True, True), "the clip must restore the job's TF32 setting"


def _noiseless_optimizer(wrapped: nn.Module, max_grad_norm: float) -> DPOptimizer:
    """A σ = 0 DP optimizer over a batch of 4, clipping the way `wrapped` records gradients."""
    base = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    return dp_optimizer(
        DPOptimizer,
        wrapped,
        base,
        noise_multiplier=0.0,
        max_grad_norm=max_grad_norm,
        expected_batch_size=4,
    )


@pytest.mark.parametrize("mode", ["hooks", "ew", "functorch"])
def test_opacus_modes_clip_in_full_fp32(tf32_on, monkeypatch, mode):
    """Opacus' norms and clipped sum (one call) see TF32 off; the job's flags come back."""
    import opacus.optimizers.optimizer as opt_mod

    seen = []
    real = opt_mod.DPOptimizer.clip_and_accumulate

    def spy(self):
        seen.append(_tf32_flags())
        return real(self)

    monkeypatch.setattr(opt_mod.DPOptimizer, "clip_and_accumulate", spy)
    model, shape, classes = CASES["cnn-gn"]()
    gsm = wrap_for_dp(model, mode)
    opt = _noiseless_optimizer(gsm, max_grad_norm=0.1)
    x, y = _data(shape, classes, n=4)
    torch.nn.functional.cross_entropy(gsm(x.float()), y).backward()
    opt.step()
    assert seen == [(False, False)], seen
    assert _tf32_flags() == (True, True)


def test_the_flags_are_restored_when_clipping_fails(tf32_on):
    model, shape, classes = CASES["cnn-gn"]()
    bk = BookKeepingModule(model)
    opt = _noiseless_optimizer(bk, max_grad_norm=1.0)
    x, _ = _data(shape, classes, n=4)
    bk(x.float())  # no backward: the clip raises
    with pytest.raises(RuntimeError, match="before the backward"):
        opt.clip_and_accumulate()
    assert _tf32_flags() == (True, True)


def test_where_launches_dominate_a_kept_conv_skips_the_ghost_paths_kernels():
    """GNResNet-10's second shortcut (1x1, 128->256, 14x14 -> 7x7): ghost by the CPU's count;
    per-example and kept where launches dominate, but only while its gradients fit `keep`."""

    conv = nn.Conv2d(128, 256, 1, stride=2, bias=False)
    a, g = torch.randn(4, 128, 14, 14), torch.randn(4, 256, 7, 7)

    def plan(launch_bound, keep=1 << 24):
        rec = rules.LayerRecord(conv, a, {"weight": conv.weight}, g)
        s = rules.Settings(keep, "auto", {}, launch_bound)
        rules.conv_weight_norms_sq(conv, rec, conv.weight, s)
        return rec.strategy, id(conv.weight) in rec.kept

    assert plan(None) == plan(False) == ("ghost", False)  # on the CPU: by the device
    assert plan(True) == ("per-example-im2col", True)
    assert plan(True, keep=4 * 128 * 256 - 1) == ("ghost", False)


def test_where_launches_dominate_no_per_example_gradient_comes_from_the_grouped_kernel(
    monkeypatch,
):
    """cuDNN runs the grouped weight-gradient kernel group by group, one group per example
    (`conv.per_example_grouped`): a GPU's bk takes per-example conv gradients from im2col,
    the CPU's still from the grouped kernel where it is faster there."""
    calls: list = []
    grouped = conv_mod.per_example_grouped
    monkeypatch.setattr(
        conv_mod, "per_example_grouped", lambda *a: calls.append(a[0]) or grouped(*a)
    )
    model, shape, classes = CASES["odd-convs"]()
    model = model.double()
    x, y = _data(shape, classes)
    ref, c = reference(copy.deepcopy(model), x, y, None)
    for launch_bound in (False, True):
        calls.clear()
        got = bk_sum(copy.deepcopy(model), x, y, c, launch_bound, strategy="per-example")
        assert float((got - ref).norm() / ref.norm()) < 1e-9
        assert bool(calls) is not launch_bound, (launch_bound, calls)


@pytest.mark.parametrize("layout", ["contiguous", "channels-last"])
def test_groupnorm_gradients_from_the_forwards_statistics(layout):
    """GroupNorm's per-example gradients from one backward kernel, with the mean and 1/std its
    forward saved or recomputed, against float64 autograd per example."""

    torch.manual_seed(0)
    gn = nn.GroupNorm(4, 8)
    with torch.no_grad():
        gn.weight.uniform_(0.5, 2)
        gn.bias.uniform_(-1, 1)
    x = (torch.randn(5, 8, 6, 7) * 3 + 2).requires_grad_(True)
    if layout == "channels-last":
        x = x.detach().contiguous(memory_format=torch.channels_last).requires_grad_(True)
    out = gn(x)
    saved = rules.group_norm_saved(gn, out)
    assert len(saved) == 2 and saved[0].shape == (5, 4)
    assert rules.group_norm_saved(gn, out.detach() + 0) == ()  # not GroupNorm's own output
    g = torch.randn_like(out)
    gn64 = copy.deepcopy(gn).double()
    want = [
        torch.stack(grads)
        for grads in zip(
            *(
                # contiguous: torch 2.13's CPU GroupNorm backward crashes (SIGSEGV) on a
                # channels-last input when only the weight's and bias' gradients are asked for
                torch.autograd.grad(
                    gn64(x[i : i + 1].double().contiguous()), gn64.parameters(), g[i : i + 1]
                )
                for i in range(5)
            ),
            strict=True,
        )
    ]
    for stats in (saved, ()):
        got = rules.norm_layer_grads(gn, x.detach(), g, stats)
        for gt, wt in zip(got, want, strict=True):
            assert torch.allclose(gt.double(), wt, rtol=1e-5, atol=1e-5)


def test_ghost_norms_are_float32_exact_at_many_positions():
    """A ghost norm sums T^2 products of two Grams; at 784 positions (a 28x28 conv) a batched
    dot product of the flattened Grams, one kernel instead of two, was 2.8e-5 off relatively in
    float32, the product and sum 1e-7 (issue 47): the clip factors come from these norms."""
    g_ = torch.Generator().manual_seed(0)
    a = torch.randn(4, 784, 9, generator=g_)
    g = torch.randn(4, 64, 784, generator=g_)
    exact = rules.ghost(a.double(), g.double())
    assert ((rules.ghost(a, g) - exact) / exact).abs().max() < 1e-6
