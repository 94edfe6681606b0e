"""Per-example gradients and clipping: every `grad_sample_mode` in one package.

`finetune.grad_sample_mode` picks how per-example gradients are had: Opacus' modes (hooks,
functorch, ew; `opacus_modes`) store them; `bk` clips without storing them (written here: the
recording hooks in `bookkeeping`, one table of per-layer closed forms in `rules`, Conv2d's
kernels in `conv`, their buffer pool in `buffers`, torch.func for every other module in
`functional`). The algorithm's DP optimizer clips the way the wrapped module records gradients:
`dp_optimizer` builds it from the class `optimizers.optimizer_class` picks for the algorithm's
class and the wrapped module (as Opacus' `get_optimizer_class`). An algorithm that reads per-
example gradients itself (`needs_per_sample_gradients`, GEP) gets Opacus' hooks under `bk`;
metrics.json records the mode that actually ran. Every clip factor comes from
`clip.clip_factors`. `precision` is `finetune.precision`: autocast of the training
forward/backward, per-example gradients cast up (and fp16's loss scale divided out) before the
clip, so that norms, clipped sums and noise stay fp32.

Wrapping first makes sure that no module mixes the examples of a batch or learns from them in
training mode (`independence`: running statistics frozen, anything else refused by name),
whatever path trains: fine-tuning, HPO, federated clients and the audit all wrap here. With the
data's `sample` shape this runs at wrap time, without it at the wrapped module's first forward.
The per-sample self-test (`self_test`) then compares the mode's per-example norms and clipped
sums with torch.func's before any step. Book-keeping's kept per-example gradients are reduced
in one arena (`arena`), and the release draws its noise in one draw (`optimizers.flat_noise`):
fewer, larger kernels (issue 47).

Layer 2: it may import the ground floor, settings, privacy, models and data (layers 0-1), never
the algorithms, the loops or anything above them, which build on it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext

import torch
from torch import nn

from dpadapter.per_sample import check_memo
from dpadapter.per_sample.bookkeeping import BookKeepingModule
from dpadapter.per_sample.clip import clip_factors
from dpadapter.per_sample.compiled import COMPILE_MODES, CompiledBookKeeping
from dpadapter.per_sample.independence import (
    Independence,
    MixedExamplesError,
    make_independent,
)
from dpadapter.per_sample.opacus_modes import OPACUS_MODES, wrap_opacus
from dpadapter.per_sample.optimizers import dp_optimizer, optimizer_class
from dpadapter.per_sample.precision import PRECISIONS, Precision, make_precision
from dpadapter.per_sample.self_test import PerSampleCheckError, run_checks

GRAD_SAMPLE_MODES = (*OPACUS_MODES, "bk")
# The record of a run whose self-test was switched off (`finetune.per_sample_check: false`):
# metrics.json, the MLflow run's tag and the report say so instead of leaving a blank.
UNVERIFIED = {
    "passed": None,
    "verified": False,
    "note": "per-example clipping unverified: the self-test was switched off "
    "(finetune.per_sample_check: false)",
}

__all__ = [
    "COMPILE_MODES",
    "GRAD_SAMPLE_MODES",
    "PRECISIONS",
    "Independence",
    "MixedExamplesError",
    "Precision",
    "PerSampleCheckError",
    "UNVERIFIED",
    "clip_factors",
    "dp_optimizer",
    "effective_mode",
    "make_precision",
    "optimizer_class",
    "wrap_for_dp",
]


def effective_mode(mode: str, needs_per_sample_gradients: bool) -> str:
    if mode not in GRAD_SAMPLE_MODES:
        raise ValueError(f"unknown grad_sample_mode {mode!r}; known: {GRAD_SAMPLE_MODES}")
    return "hooks" if mode == "bk" and needs_per_sample_gradients else mode


def wrap_for_dp(
    model: nn.Module,
    mode: str,
    needs_per_sample_gradients: bool = False,
    sample: tuple[Sequence[int], torch.dtype] | None = None,
    *,
    check: bool = True,
    check_batch: int | None = None,
    check_memo_path: str | None = None,
    compile: str = "off",
    phase: Callable[[str], AbstractContextManager] = lambda name: nullcontext(),
) -> nn.Module:
    """The module to train (loss reduction 'mean', batch first, as everywhere here).

    `sample` is the training data's sample shape and dtype (never its values). With it, the
    independence check (`independence.make_independent`) runs now and, if `check`, the
    per-sample self-test, on `check_batch` synthetic examples (the physical batch size
    training will use; default `self_test.EXAMPLES`). Without it, the independence check runs
    at the wrapped module's first forward, on that batch's shape, and no self-test runs.
    `check_memo_path` (a results folder's `check_memo.memo_path`) runs the self-test once per
    architecture, mode and shapes in that folder; None runs it every time.
    `compile` (`finetune.compile`): off, or torch.compile's mode for bk's forward and backward
    (`compiled`); the self-test then checks the compiled path.
    `phase(name)` times the two checks apart (a training job's `PhaseClock.phase`:
    "independence_check", "self_test"): on a GPU they took 50 s of a Table 2 cell.
    The results are left on the wrapped module: `independence` (an `Independence`; None until
    it has run) and `per_sample_check` (the self-test's record, or None). A module that mixes
    examples raises MixedExamplesError; a self-test mismatch PerSampleCheckError.
    """
    mode = effective_mode(mode, needs_per_sample_gradients)
    if compile != "off" and mode != "bk":
        raise ValueError(
            f"finetune.compile: {compile!r} compiles book-keeping (bk) only; this run clips "
            f"in Opacus' {mode!r} mode (an algorithm that reads per-example gradients runs "
            "hooks): set compile: off"
        )

    def wrap() -> nn.Module:
        if mode == "bk" and compile != "off":
            return CompiledBookKeeping(model, mode=compile, loss_reduction="mean")
        if mode == "bk":
            return BookKeepingModule(model, loss_reduction="mean")
        return wrap_opacus(model, mode)

    if sample is None:
        wrapped, record, found = wrap(), None, None
    else:
        shape, dtype = tuple(sample[0]), sample[1]
        with phase("independence_check"):
            found = make_independent(model, shape, dtype)
        _report(found)
        if check:
            with phase("self_test"):
                wrapped, record = check_memo.run_or_recall(
                    check_memo_path,
                    model,
                    wrap,
                    mode if compile == "off" else f"{mode}+compile:{compile}",
                    shape,
                    dtype,
                    check_batch,
                    lambda: run_checks(
                        model, wrap, dp_optimizer, mode, shape, dtype, examples=check_batch
                    ),
                )
        else:
            wrapped, record = wrap(), dict(UNVERIFIED)
    wrapped.per_sample_check = record
    wrapped.independence = found
    if found is None:
        _check_at_first_forward(model, wrapped)
    return wrapped


def _report(found: Independence) -> None:
    if found.frozen:
        print(
            "DP training: frozen statistics (eval mode: the pre-trained running statistics, "
            "never updated from private data): " + ", ".join(found.frozen),
            flush=True,
        )


def _check_at_first_forward(model: nn.Module, wrapped: nn.Module) -> None:
    """The independence check on the first batch's shape, before its forward runs."""

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        x = next((v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)), None)
        if x is None or x.dim() == 0:
            return
        handle.remove()
        wrapped.independence = make_independent(model, tuple(x.shape[1:]), x.dtype)
        _report(wrapped.independence)

    handle = wrapped.register_forward_pre_hook(hook, with_kwargs=True)
