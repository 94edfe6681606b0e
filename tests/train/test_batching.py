"""Fixed-shape physical batches: padding with masked rows must not change what DP releases."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from noiseless import dp_sgd  # tests/ is on sys.path
from torch.utils.data import DataLoader, TensorDataset

from dpadapter.algorithms import ALGORITHMS
from dpadapter.data import build_splits, public_train
from dpadapter.ground.device import full_fp32
from dpadapter.models import create_model, replace_head
from dpadapter.per_sample import wrap_for_dp
from dpadapter.settings import ModelConfig
from dpadapter.train.batching import (
    PAD_LABEL,
    PoissonBatches,
    ShuffledBatches,
    masked_cross_entropy,
    padded_size,
    wants_padding,
)
from dpadapter.train.dp_fit import FitSettings, dp_fit
from dpadapter.train.dp_spec import run_spec


@pytest.fixture
def no_tf32():
    """Padded and unpadded runs must agree to float rounding: on a GPU, TF32's 10-bit inputs
    would make them differ by far more (its flags are global, so pinned off here)."""
    with full_fp32():
        yield


def _model(seed=0):
    return create_model(ModelConfig("cnn-gn", 4, 8), num_classes=5, in_chans=1, seed=seed)


@pytest.mark.usefixtures("no_tf32")
@pytest.mark.parametrize("mode", ["hooks", "ew", "functorch", "bk"])
def test_padded_batch_gives_the_same_clipped_sum(mode):
    torch.manual_seed(0)
    x, y = torch.randn(7, 1, 16, 16), torch.randint(0, 5, (7,))
    sums = []
    for pad in (0, 9):
        wrapped = wrap_for_dp(_model(), mode)  # bk: the hand-written book-keeping clipping
        opt = dp_sgd(
            wrapped, 0.05, 7, lr=0.1
        )  # small: every example is clipped, so scaling errors show
        xp = torch.cat([x, torch.zeros(pad, 1, 16, 16)])
        yp = torch.cat([y, torch.full((pad,), PAD_LABEL)])
        masked_cross_entropy(wrapped(xp), yp).backward()
        if mode == "bk":
            norms = wrapped.per_sample_norms(opt.params)
        else:
            norms = torch.stack(
                [p.grad_sample.reshape(len(yp), -1).norm(dim=1) for p in opt.params], dim=1
            ).norm(dim=1)
        assert len(norms) == 7 + pad and torch.all(norms[:7] > 0)
        assert torch.all(norms[7:] == 0), "padded rows must have exactly zero gradient"
        opt.clip_and_accumulate()
        sums.append(torch.cat([p.summed_grad.reshape(-1) for p in opt.params]))
    assert torch.allclose(sums[0], sums[1], atol=1e-7, rtol=1e-5)
    assert sums[0].abs().sum() > 0


def test_unpadded_masked_loss_equals_mean_cross_entropy():
    logits, y = torch.randn(6, 5), torch.randint(0, 5, (6,))
    ref = torch.nn.functional.cross_entropy(logits, y)
    assert torch.allclose(masked_cross_entropy(logits, y), ref)
    padded = torch.cat([logits, torch.randn(3, 5)]), torch.cat([y, torch.full((3,), PAD_LABEL)])
    assert torch.allclose(masked_cross_entropy(*padded) * 9 / 6, ref)


def test_poisson_batches_match_opacus_dp_data_loader_and_pad_to_one_shape():
    from opacus.data_loader import DPDataLoader

    data = TensorDataset(torch.randn(200, 3), torch.arange(200))
    ref = DPDataLoader(data, sample_rate=0.1, generator=torch.Generator().manual_seed(3))
    ours = PoissonBatches(data, 0.1, torch.Generator().manual_seed(3), torch.device("cpu"))
    assert len(ours) == len(ref)
    for (_, a), (_, b) in zip(ref, ours, strict=True):
        assert torch.equal(a, b)
    # An iterator made and dropped (the training loop's tqdm.auto makes one in its
    # constructor) draws from the generator in both, when it is made.
    ref = DPDataLoader(data, sample_rate=0.1, generator=torch.Generator().manual_seed(3))
    ours = PoissonBatches(data, 0.1, torch.Generator().manual_seed(3), torch.device("cpu"))
    iter(ref), iter(ours)
    for (_, a), (_, b) in zip(ref, ours, strict=True):
        assert torch.equal(a, b)

    class _Opt:  # what BatchSplittingSampler and the padding talk to
        def signal_skip_step(self, do_skip):
            pass

    size = padded_size(20, 0.1)
    padded = PoissonBatches(
        data, 0.1, torch.Generator().manual_seed(3), torch.device("cpu"), size, True, _Opt()
    )
    shapes = {tuple(x.shape) for x, _ in padded}
    assert shapes == {(size, 3)}


def test_shuffled_batches_equal_a_shuffling_data_loader():
    data = TensorDataset(torch.randn(53, 2), torch.arange(53))
    ref = DataLoader(data, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(1))
    ours = ShuffledBatches(data, 8, torch.Generator().manual_seed(1))
    for _ in range(2):
        for (_, a), (_, b) in zip(ref, ours, strict=True):
            assert torch.equal(a, b)


@pytest.mark.slow  # in-process, too long for `make check`
@pytest.mark.parametrize("algo", sorted(ALGORITHMS))
@pytest.mark.parametrize("physical,mode", [(None, "ew"), (16, "ew"), (16, "bk")])
def test_padding_changes_no_algorithm_update(algo, physical, mode, tiny_cfg):
    """Every registered algorithm: the same weights with padded and with unpadded batches.

    The padded run pads to `physical` rows (splitting larger Poisson batches into virtual
    steps) or, with None, to the automatic size; the reference uses the same physical limit
    unpadded. Same sampling, same noise draws, so any difference is the padding's. `bk` (the
    hand-written clipping, which the GPU runs pad for) is checked with virtual steps.
    """
    ft_cfg = dataclasses.replace(
        tiny_cfg.finetune, physical_batch_size=physical, grad_sample_mode=mode
    )
    cfg = dataclasses.replace(tiny_cfg, finetune=ft_cfg)
    _, roles = build_splits(cfg, ["syn-same"])
    train = roles["syn-same"].train
    spec = dataclasses.replace(run_spec(cfg, algo, 2.0, len(train)), epochs=1)
    start = replace_head(_model(), 5, 0)
    # GEP's power method turns float-rounding differences of one update (~2e-7: the clipped sum
    # is added over a longer batch) into a visibly different anchor basis at the next refresh
    # (its top singular values are nearly equal here), so it is compared over one step.
    max_steps = 1 if algo == "gep" else None
    # The production paths: unpadded on the CPU, Opacus' DPDataLoader (split by
    # `wrap_data_loader`); padded, `PoissonBatches` (a GPU's path).
    out = []
    for pad in (False, True):
        run_cfg = dataclasses.replace(  # tf32 off: dp_fit sets the flags from the config
            cfg, tf32=False, finetune=dataclasses.replace(cfg.finetune, pad_batches=pad)
        )
        model = copy.deepcopy(start)
        settings = FitSettings.from_config(run_cfg)
        algo_run, ledger = dp_fit(
            model, train, algo, spec, settings, 0, public=public_train(cfg), max_steps=max_steps
        )
        out.append((model.state_dict(), ledger.steps, algo_run.describe()))
    (wa, sa, da), (wb, sb, db) = out
    assert sa == sb == (max_steps or spec.total_steps)
    for k in wa:
        assert torch.allclose(wa[k], wb[k], atol=1e-5, rtol=1e-4), (algo, k)
    if algo == "adpclip":  # the count excludes padded rows, so the clip bound evolves alike
        assert da["noise_multiplier"] == db["noise_multiplier"]


@pytest.mark.parametrize("kind", ["poisson-padded", "shuffled"])
def test_rows_of_a_pinned_dataset_are_gathered_into_pinned_buffers(kind, monkeypatch):
    """A dataset left in pinned host memory (too large for the GPU): each batch is gathered
    into a pinned buffer (so its copy is asynchronous), with the rows plain indexing gives.
    Pinning needs CUDA, so the CPU test forces the pinned path and records the buffers."""
    import dpadapter.ground.device as devices

    data = TensorDataset(torch.randn(120, 3, 2), torch.arange(120))
    cpu = torch.device("cpu")

    def batches():
        g = torch.Generator().manual_seed(5)
        if kind == "shuffled":
            return list(ShuffledBatches(data, 16, g, cpu))

        class _Opt:
            def signal_skip_step(self, do_skip):
                pass

        return list(PoissonBatches(data, 0.1, g, cpu, 24, True, _Opt()))

    reference = batches()
    staged: list[torch.Tensor] = []

    def pinned_empty(shape, dtype):
        staged.append(torch.empty(shape, dtype=dtype))
        return staged[-1]

    monkeypatch.setattr(devices, "_is_pinned", lambda t: True)
    monkeypatch.setattr(devices, "_pinned_empty", pinned_empty)
    forced = batches()
    assert len(staged) == 2 * len(reference), "every batch's x and y go through a pinned buffer"
    for (xa, ya), (xb, yb) in zip(reference, forced, strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    if kind == "shuffled":  # unpadded: what is yielded is the pinned buffer itself
        assert all(any(x is s for s in staged) for x, _ in forced)


@pytest.mark.parametrize(
    "mode,device,compiled,pads",
    [
        ("auto", "cpu", False, False),  # an eager CPU run keeps Opacus' unpadded stream
        ("auto", "cuda", False, True),  # cuDNN tunes per shape
        ("auto", "cpu", True, True),  # a compiled step is compiled once per shape
        (False, "cuda", True, False),  # asked not to (config validation refuses it compiled)
        (True, "cpu", False, True),
    ],
)
def test_auto_pads_on_cuda_and_for_a_compiled_step(mode, device, compiled, pads):
    assert wants_padding(mode, torch.device(device), compiled) is pads
