"""`finetune.compile`: book-keeping with a compiled forward and backward (per_sample.compiled).

Every model family the suite clips with bk (the registered models, the odd layer kinds, timm's
ViTs, ConvNeXt and a frozen-BatchNorm ResNet) trains compiled to the same clipped sum as the
float64 per-example reference. Dynamo and AOTAutograd trace and differentiate the same graphs
for every backend; the families run on `aot_eager` (those graphs, executed by eager kernels:
seconds), and one family also on `inductor`, which generates the fused kernels a user gets
(tens of seconds of C++ compilation on two cores: once per physical batch shape).
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch._dynamo
from noiseless import dp_sgd  # tests/ is on sys.path
from test_bookkeeping import CASES, LOSS, _data, bk_sum, reference
from test_bookkeeping_any_module import CASES as ANY_CASES
from test_bookkeeping_any_module import _bk_run, _clipped
from test_bookkeeping_any_module import _data as any_data
from test_bookkeeping_any_module import reference as func_reference
from torch._dynamo.utils import counters

from dpadapter.per_sample import wrap_for_dp
from dpadapter.per_sample.bookkeeping import BookKeepingModule
from dpadapter.per_sample.compiled import COMPILE_MODES, CompiledBookKeeping
from dpadapter.train.batching import PAD_LABEL, masked_cross_entropy, pad_batch

# compiles every model it checks: minutes of CPU, too long for `make check`
pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


@pytest.fixture
def restarts():
    """Dynamo's restarts of an analysis (a phase traced again from the start: an `assert` on a
    list in a compiled phase did that), as its log says them."""
    said: list[str] = []

    class Said(logging.Handler):
        def emit(self, record):
            if "Restarting analysis" in record.getMessage():
                said.append(record.getMessage())

    log, handler = logging.getLogger("torch._dynamo.convert_frame"), Said()
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    yield said
    log.removeHandler(handler)
    log.setLevel(level)


def compiled(backend="aot_eager", made: list | None = None):
    """A factory of compiled bk modules (the test modules' `BookKeepingModule`); `made`
    collects them."""

    def make(model, **kw):
        bk = CompiledBookKeeping(model, backend=backend, **kw)
        if made is not None:
            made.append(bk)
        return bk

    return make


@pytest.mark.parametrize("case", sorted(CASES))
def test_compiled_clipped_sum_equals_the_per_example_reference(case, monkeypatch, restarts):
    model, shape, classes = CASES[case]()
    model = model.double()
    x, y = _data(shape, classes)
    ref, c = reference(copy.deepcopy(model), x, y, None)
    made = []
    monkeypatch.setattr("test_bookkeeping.BookKeepingModule", compiled(made=made))
    got = bk_sum(copy.deepcopy(model), x, y, c)
    err = float((got - ref).norm() / ref.norm())
    assert err < 1e-9, f"{case}: relative error {err:.3g}"
    (bk,) = made
    # one planning forward for the two physical batches of one shape; every recorded forward
    # ran the compiled graph, whole: no graph break (each break is a launch boundary)
    assert bk.plans_made == 1
    # three graphs, each whole: the model's forward (its backward derived from it), and the
    # rules' two phases, the norms and the clip-weighted sums (`CompiledBookKeeping._norms`)
    assert counters["stats"]["unique_graphs"] == 3
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert not restarts, restarts  # each phase traced once (compile time)


def test_a_gpus_choices_compile_whole_with_the_patches_in_chunks(monkeypatch):
    """Where launches dominate (a GPU), per-example conv gradients come from im2col patches
    in chunks of examples (`conv.PATCH_ELEMENTS`, here one example each): the same sum,
    traced whole."""
    from dpadapter.per_sample import conv

    model, shape, classes = CASES["odd-convs"]()
    model = model.double()
    x, y = _data(shape, classes)
    ref, c = reference(copy.deepcopy(model), x, y, None)
    monkeypatch.setattr(conv, "PATCH_ELEMENTS", 1)
    monkeypatch.setattr("test_bookkeeping.BookKeepingModule", compiled())
    got = bk_sum(copy.deepcopy(model), x, y, c, launch_bound=True, strategy="per-example")
    assert float((got - ref).norm() / ref.norm()) < 1e-9
    assert not counters["graph_break"], dict(counters["graph_break"])


@pytest.mark.parametrize("case", sorted(ANY_CASES))
def test_compiled_timm_families_match_the_torch_func_reference(case, monkeypatch, restarts):
    torch.manual_seed(0)
    model = ANY_CASES[case]().double()
    x, y = any_data()
    ref = func_reference(model, x, y)
    ref_norms = ref.norm(dim=1)
    c = float(ref_norms.median())
    monkeypatch.setattr("test_bookkeeping_any_module.BookKeepingModule", compiled())
    norms, summed, bk = _bk_run(copy.deepcopy(model), x, y, c)
    assert isinstance(bk, CompiledBookKeeping) and bk.plans_made == 1
    assert float((norms - ref_norms).abs().max() / ref_norms.max()) < 1e-10
    want = _clipped(ref, c)
    assert float((summed - want).norm() / want.norm()) < 1e-10
    assert not restarts, restarts


@pytest.mark.process  # inductor runs the C++ compiler
def test_inductor_kernels_give_the_reference_sum():
    """The generated kernels themselves (not only the traced graphs), float64 on the CPU, on
    the odd layers (strided, dilated, grouped, biased convolutions, GroupNorm, an in-place
    ReLU): the fewest kernels to compile that still cover every closed form but LayerNorm."""
    model, shape, classes = CASES["odd-convs"]()
    model = model.double()
    x, y = _data(shape, classes)
    ref, c = reference(copy.deepcopy(model), x, y, None)
    bk = CompiledBookKeeping(copy.deepcopy(model), backend="inductor")
    opt = dp_sgd(bk, c, len(y))
    half = len(y) // 2
    for part in (slice(0, half), slice(half, None)):
        LOSS(bk(x[part]), y[part]).backward()
        opt.clip_and_accumulate()
    got = torch.cat([p.summed_grad.reshape(-1) for p in opt.params])
    assert float((got - ref).norm() / ref.norm()) < 1e-9
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["inductor"], "inductor compiled nothing"


def test_a_padded_example_changes_nothing():
    """Padded rows (label PAD_LABEL, zero loss) in the compiled step: the clipped sum is the
    unpadded batch's, within float64 rounding of the eager one. The embedded CNN (GroupNorm,
    convolutions, a linear head): padding concerns rows, not layers, and its trace costs a
    fraction of GNResNet-10's, whose compiled sum the parametrized test checks."""
    model, shape, classes = CASES["cnn-gn"]()
    model = model.double()  # float64: only summation order differs between the three
    x, y = _data(shape, classes, n=6)
    c = _median_norm(model, x, y)
    sums = {}
    for name, make in (("eager", BookKeepingModule), ("compiled", compiled())):
        bk = make(copy.deepcopy(model))
        opt = dp_sgd(bk, c, 8)
        xp, yp = pad_batch(x, y, 8)
        assert (yp[6:] == PAD_LABEL).all()
        masked_cross_entropy(bk(xp), yp).backward()
        norms = bk.per_sample_norms(opt.params)
        assert torch.equal(norms[6:], torch.zeros(2, dtype=norms.dtype)), norms
        opt.clip_and_accumulate()
        sums[name] = [p.summed_grad.clone() for p in opt.params]
    bk = BookKeepingModule(copy.deepcopy(model))  # the same six examples, unpadded, eager
    opt = dp_sgd(bk, c, 8)
    LOSS(bk(x), y).backward()
    opt.clip_and_accumulate()
    unpadded = [p.summed_grad for p in opt.params]
    for a, b, u in zip(sums["eager"], sums["compiled"], unpadded, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(a, u, rtol=1e-10, atol=1e-12)


def test_a_new_trained_set_gets_its_own_plan_and_requires_grad_is_restored():
    """UT's phases: the head first, then every parameter. The switched-off weights are
    switched back on after each compiled forward, and each phase's sum is the eager one's.
    The embedded CNN: its trace costs a tenth of ResNet20-GN's, whose compiled sum the
    parametrized test above checks."""
    model, shape, classes = CASES["cnn-gn"]()
    x, y = _data(shape, classes, n=4)
    x = x.float()
    c = _median_norm(model, x, y)
    results = {}
    for name, make in (("eager", BookKeepingModule), ("compiled", compiled())):
        m = copy.deepcopy(model)
        bk = make(m)
        out = []
        for head_only in (True, False, False):
            for n_, p in m.named_parameters():
                p.requires_grad_(not head_only or n_.startswith("head") or n_.startswith("fc"))
            before = {n_: p.requires_grad for n_, p in m.named_parameters()}
            opt = dp_sgd(bk, c, 4)
            LOSS(bk(x), y).backward()
            opt.clip_and_accumulate()
            out.append([p.summed_grad.clone() for p in opt.params])
            assert {n_: p.requires_grad for n_, p in m.named_parameters()} == before
        results[name] = out
        if name == "compiled":
            assert bk.plans_made == 2  # one per trained set; the third step reuses the second
    for a, b in zip(results["eager"], results["compiled"], strict=True):
        assert len(a) == len(b) and len(a) > 0
        for u, v in zip(a, b, strict=True):
            torch.testing.assert_close(v, u, rtol=1e-5, atol=1e-7)
    assert len(results["eager"][0]) < len(results["eager"][1])


def test_compile_refuses_opacus_modes():
    model, shape, _ = CASES["cnn-gn"]()
    with pytest.raises(ValueError, match="compiles book-keeping"):
        wrap_for_dp(model, "bk", needs_per_sample_gradients=True, compile="default")


def _median_norm(model, x, y) -> float:
    """A bound that clips half the examples, so that a wrong gradient scale shows in the sum
    (fully clipped examples hide it)."""
    bk = BookKeepingModule(copy.deepcopy(model))
    opt = dp_sgd(bk, 1.0, len(y))
    LOSS(bk(x), y).backward()
    return float(bk.per_sample_norms(opt.params).median())


def _with_backend(compile_fn, backend):
    def call(module, **kw):
        return compile_fn(module, **{**kw, "backend": backend})

    return call


def test_a_compiled_fit_pads_and_trains_as_the_eager_one(monkeypatch):
    """`finetune.compile` through dp_fit: `pad_batches: auto` pads when compiling (one shape),
    the privacy ledger is the eager run's, and so are the weights, to float32 rounding. The
    wrap-time self-test's verdict is about the module that trains: its forwards went through
    the compiled path (this test also holds what a test of `wrap_for_dp(compile=...)` alone
    held, whose compile of the same network it repeated)."""
    from torch.utils.data import TensorDataset

    import dpadapter.train.dp_fit as fit_module
    from dpadapter.algorithms import DPRunSpec
    from dpadapter.train.dp_fit import FitSettings, dp_fit

    monkeypatch.setattr(
        "dpadapter.per_sample.compiled.torch.compile",
        _with_backend(torch.compile, "aot_eager"),
    )
    wrapped = []  # (the module dp_fit trains, its plans when the self-test was done)

    def spy(*args, **kw):
        module = wrap_for_dp(*args, **kw)
        wrapped.append((module, getattr(module, "plans_made", None)))
        return module

    monkeypatch.setattr(fit_module, "wrap_for_dp", spy)
    base, shape, classes = CASES["cnn-gn"]()
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, *shape, generator=g), torch.randint(0, classes, (64,)))
    spec = DPRunSpec(
        target_epsilon=8.0, delta=1e-5, sample_rate=0.25, steps_per_epoch=4, epochs=1,
        expected_batch_size=16, max_grad_norm=1.0,
    )  # fmt: skip
    runs = {}
    for mode in ("off", "default"):
        model = copy.deepcopy(base)
        settings = FitSettings(0.5, 0.0, "bk", None, "auto", "cpu", False, compile=mode)
        algo, ledger = dp_fit(model, data, "dpsgd", spec, settings, 0)
        runs[mode] = (model, ledger, algo)
    (eager, l_eager, _), (comp, l_comp, algo) = runs["off"], runs["default"]
    assert l_comp.history == l_eager.history and l_comp.epsilon() == l_eager.epsilon()
    assert algo.per_sample_check["passed"] is True
    (_, (trained, plans_at_check)) = wrapped
    assert isinstance(trained, CompiledBookKeeping) and trained.per_sample_check["passed"] is True
    assert plans_at_check >= 1  # the self-test's forwards ran the compiled module
    for a, b in zip(eager.parameters(), comp.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)
    moved = zip(base.parameters(), comp.parameters(), strict=True)
    assert not all(torch.equal(a, b) for a, b in moved)  # it trained


def test_a_forward_without_its_backward_leaves_no_stale_gradient():
    """The taps are reused across a plan's calls: the second forward's records must not take
    the first backward's output gradients."""
    model, shape, classes = CASES["cnn-gn"]()
    x, y = _data(shape, classes, n=4)
    bk = compiled()(model)
    opt = dp_sgd(bk, 1.0, 4)
    LOSS(bk(x.float()), y).backward()
    bk.per_sample_norms(opt.params)  # a full step's records
    bk(x.float())  # forward only
    with pytest.raises(RuntimeError, match="before the backward pass"):
        bk.per_sample_norms(opt.params)


def _inductor_config(kwargs: dict) -> dict:
    """What inductor runs a `torch.compile(**kwargs)` with: its mode's options from inductor's
    own table, then the options given, over the global config (as torch.compile applies them)."""
    from torch._inductor import config, list_mode_options

    mode, options = kwargs.get("mode"), kwargs.get("options") or {}
    effective = {"triton.cudagraphs": config.triton.cudagraphs}
    if mode and mode != "default":
        effective.update(list_mode_options(mode))
    effective.update(options)
    return effective


@pytest.mark.parametrize("mode", COMPILE_MODES[1:])
def test_no_compile_mode_puts_the_rule_phases_in_cuda_graphs(mode, monkeypatch):
    """Issue 66 item 4: every mode, `max-autotune` (CUDA graphs on in current torch) included,
    compiles the norms and sums phases without CUDA graphs, and the forward with the mode as
    given; read from the arguments each `torch.compile` call receives."""
    calls = []

    def record(fn, **kwargs):
        calls.append((fn, kwargs))
        return fn

    monkeypatch.setattr(torch, "compile", record)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2))
    bk = CompiledBookKeeping(model, mode=mode, backend="inductor")
    forward = [kw for fn, kw in calls if fn is model]
    phases = {getattr(fn, "__name__", ""): kw for fn, kw in calls if fn is not model}
    assert forward == [{"mode": mode, "backend": "inductor", "dynamic": False}]
    assert set(phases) == {"_norms", "_sums"}
    for name, kw in phases.items():
        assert kw["backend"] == "inductor" and kw["dynamic"] is False
        assert _inductor_config(kw)["triton.cudagraphs"] is False, (name, kw)
        # the mode's other options stay (max-autotune's tuning)
        if mode != "default":
            wanted = dict(torch._inductor.list_mode_options(mode), **{"triton.cudagraphs": False})
            assert _inductor_config(kw) | wanted == _inductor_config(kw)
    assert bk._compiled_norms is not None


def test_the_cudagraphs_backend_is_refused_for_the_rule_phases():
    with pytest.raises(ValueError, match="CUDA graphs"):
        CompiledBookKeeping(torch.nn.Linear(3, 2), backend="cudagraphs")
