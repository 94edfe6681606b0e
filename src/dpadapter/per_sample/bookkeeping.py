"""Book-keeping per-sample clipping (`finetune.grad_sample_mode: bk`): the recording hooks.

Where the method lives: this module records (step 1 below) and asks, layer by layer, the
table of closed forms (`rules`, step 2 and 3; Conv2d's kernels in `conv`, their buffers in
`buffers`) or the torch.func fallback (`functional`); the DP optimizer built for the wrapped
module (`optimizers.optimizer_class`) takes its norms and clipped sums from here.

Why by hand: Opacus 1.6 either stores every per-sample gradient (hooks, functorch, expanded
weights) or, in fast gradient clipping, pays a second backward pass for the clipped sum, and it
has ghost norms only for Linear and Embedding layers. The book-keeping method of Bu et al.
(2023, "Differentially private optimization on large model at small cost") needs one backward:

1. Forward with hooks that keep each trainable layer's input `a`; one backward that computes
   the loss gradient `g` at every trainable layer's output but not the weights' (unclipped)
   gradients, which DP never uses: a layer whose input already requires grad has its weights'
   `requires_grad` switched off for the forward, so autograd skips their gradient kernels.
   The first trainable layer (its input needs no gradient) keeps its weights on; autograd's
   unclipped gradient there costs what the input gradient would, and Opacus' noise step
   overwrites `p.grad` anyway.
2. Per-example gradient norms from (a, g), layer by layer, by whichever is cheaper (mixed ghost
   clipping): the ghost norm `sum_ts (a_t . a_s)(g_t . g_s)` costs T^2 (d + p) per example for
   T positions, d inputs and p outputs; the per-example gradient `g^T a` costs T d p and is
   freed as soon as its norm is taken (a conv's from im2col + bmm for stems with few input
   channels, else from one grouped weight-gradient kernel). A Linear layer on flat inputs has
   the exact product `|g| |a|`; GroupNorm/LayerNorm per-example gradients are small (one
   value per channel).
3. The clipped sum `sum_i c_i g_i^T a_i` as one weight-gradient kernel per layer on the clip-
   weighted output gradients (`convolution_backward` for Conv2d, a matrix product for Linear):
   per-example gradients are never stored for the whole model.

The result is Opacus' `clip_and_accumulate` to float tolerance (tests/per_sample/
test_bookkeeping.py against a per-example loop, and the algorithm suite in bk mode): the same
clip factor `min(1, C / (|g_i| + 1e-6))`, the same `summed_grad`, so Opacus' noise, scaling,
virtual steps and every algorithm's phases run unchanged on top. Algorithms that read the
per-example gradients themselves (GEP's projection) declare `needs_per_sample_gradients`;
for them `bk` runs Opacus' hooks mode, since their cost is in the gradients this avoids.

Numerics on CUDA: the norms (step 2) and the clipped sum (step 3) come from different kernels (a
Gram product or a per-example gradient against one weight-gradient kernel). Under TF32 their
inputs are rounded differently, and a clipped example's contribution to the sum could exceed C
by ~1e-3 relative, i.e. more than the sensitivity the accountant is told. The optimizer's
clipping (`optimizers`) therefore runs in full FP32 (`dpadapter.ground.device.full_fp32`: TF32
off for matmuls and cuDNN convolutions, the previous flags restored afterwards), so both agree
to FP32 rounding as on the CPU; the model's forward and backward keep TF32 (config `tf32`).
Clipping at a reduced bound was the alternative; it would need a proven bound on TF32's error
for every kernel.

Closed forms (`rules.RULES`): Linear (any leading dims), Conv2d (zeros padding, any groups,
stride, dilation), GroupNorm, LayerNorm, each only where its class keeps the base class' forward
(timm's LayerNorm2d normalises over channels with a forward of its own), and a timm ViT's own
tokens (`cls_token`, `reg_token`, `pos_embed`: slices of the gradient where `_pos_embed` adds
them, `tokens`). Every other module that owns trainable parameters (LayerScale, an eval-mode
BatchNorm or any frozen-statistics norm, a padded Conv2d subclass, an Embedding) records its
call's arguments and its output gradient in the same forward/backward, and its per-example
gradients come from torch.func, for that module's own parameters only (`functional`): mixed with
the closed forms, so that any model trains under bk. Such a module keeps its parameters'
gradients switched off like the closed-form layers do when an input already needs one.

Refused, naming the module, because the result would be wrong: a module with trained
parameters called twice in one forward, a trained parameter shared by two modules (tied
weights, `shared`), a BatchNorm in training mode (its output mixes the
examples of the batch), a fallback module whose output is not one batch-first tensor, and a
fallback forward that draws random numbers (dropout inside it: the replay would draw others).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

from dpadapter.per_sample import arena, functional, norm_fusion, rules
from dpadapter.per_sample.buffers import Workspace
from dpadapter.per_sample.clip import folded_rows_error
from dpadapter.per_sample.functional import FuncRecord
from dpadapter.per_sample.independence import (
    detached,
    mixes_examples,
    refuse_unsupported,
    unsupported_trainable,
)
from dpadapter.per_sample.rules import SUPPORTED_LAYERS, LayerRecord, closed_form
from dpadapter.per_sample.shared import refuse_shared
from dpadapter.per_sample.tokens import TokenLayout, token_layout

__all__ = ["SUPPORTED_LAYERS", "BookKeepingModule", "closed_form", "unsupported_trainable"]


def _owns_parameters(m: nn.Module) -> bool:
    return any(True for _ in m.parameters(recurse=False))


class BookKeepingModule(nn.Module):
    """Wraps a model: records (input, output gradient) of every trainable layer per batch.

    `loss_reduction` "mean" (Opacus' convention) scales the output gradients by the physical
    batch size, so that per-example gradients are those of each example's own loss.
    """

    # a GroupNorm's input gradient and per-example gradients from one kernel (`norm_fusion`)
    fuse_norms = True

    def __init__(
        self,
        module: nn.Module,
        loss_reduction: str = "mean",
        keep_elements: int = 1 << 24,
        strategy: str = "auto",
    ):
        super().__init__()
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"loss_reduction must be 'mean' or 'sum', not {loss_reduction!r}")
        refuse_unsupported(module)
        refuse_shared(module)  # tied weights (`shared`)
        self._module = module
        self.loss_reduction = loss_reduction
        # Per-example gradients of a layer up to this many elements (64 MiB in float32) are
        # kept between the norms and the clipped sum; larger ones are recomputed as one
        # weight-gradient kernel on the clip-weighted output gradients.
        self.keep_elements = keep_elements
        # "auto": per layer, the cheaper of ghost norm and per-example gradient (see
        # rules.conv_weight_norms_sq); "ghost" / "per-example" force one (tests, benchmarks).
        if strategy not in ("auto", "ghost", "per-example"):
            raise ValueError(f"strategy must be auto, ghost or per-example, not {strategy!r}")
        self.strategy = strategy
        # whether kernel launches dominate the norms' cost (`rules.Settings.launch_bound`):
        # None decides by the device; the op-count bench forces True to count a GPU's choices
        self.launch_bound: bool | None = None
        self.last_plan: dict[str, str] = {}  # layer -> how its norms were computed (first batch)
        # Reused patch buffers for ghost norms and im2col, one per layout (`buffers`).
        self.workspace: Workspace | None = {}  # None: fresh tensors (`compiled`)
        self.records: dict[nn.Module, LayerRecord | FuncRecord] = {}
        self._arenas: list[arena.Arena] = []  # the last norms' kept gradients (`arena`)
        # fp16's loss scale of the last backward (per_sample.precision); 1 otherwise
        self.grad_scale = 1.0
        self._switched_off: list[nn.Parameter] = []
        self._rows: int | None = None  # the batch size of the current forward
        self._replaying = False  # torch.func runs a module's forward again: record nothing
        self._norm_weights = norm_fusion.RepeatedWeights.of_model(module)  # `norm_fusion`
        self._handles = []
        for name, m in module.named_modules():
            if closed_form(m):
                self._handles.append(m.register_forward_pre_hook(self._before_layer))
                self._handles.append(m.register_forward_hook(self._after_layer))
            elif (layout := token_layout(m)) is not None:
                self._handles.append(m.register_forward_pre_hook(self._before_tokens(name, layout)))
                self._handles.append(m.pos_drop.register_forward_pre_hook(self._at_tokens(m)))
            elif _owns_parameters(m):
                self._handles.append(
                    m.register_forward_pre_hook(self._before_func(name), with_kwargs=True)
                )
                self._handles.append(
                    m.register_forward_hook(self._after_func(name), with_kwargs=True)
                )

    # --- recording ---------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        recording = torch.is_grad_enabled() and not self._replaying
        if recording:
            self.records = {}
            self._arenas = []
            self._norm_weights.clear()
            refuse_unsupported(self._module)  # a strategy may have unfrozen another layer
            refuse_shared(self._module)
            first = next((a for a in tree_leaves((args, kwargs)) if torch.is_tensor(a)), None)
            self._rows = None if first is None or first.dim() == 0 else first.shape[0]
        try:
            return self._call(recording, *args, **kwargs)
        finally:
            self._switch_back()

    def _call(self, recording: bool, *args: Any, **kwargs: Any) -> Any:
        """The wrapped model's forward (`compiled` runs a compiled one)."""
        return self._module(*args, **kwargs)

    def _first_call(self, module: nn.Module, what: str, hint: str) -> dict[str, nn.Parameter]:
        """The module's trained parameters; a second call in one forward is refused (checked
        first: after the first call its parameters may be switched off)."""
        if module in self.records:
            raise RuntimeError(
                f"grad_sample_mode 'bk': {what} is called twice in one forward; {hint}"
            )
        return self._trained(module)

    def _trained(self, module: nn.Module) -> dict[str, nn.Parameter]:
        return {n: p for n, p in module.named_parameters(recurse=False) if p.requires_grad}

    def _switch_off(self, trained: dict[str, nn.Parameter]) -> None:
        """No unclipped weight gradient where the output's gradient flows on anyway (restored
        after the forward)."""
        for p in trained.values():
            p.requires_grad_(False)
            self._switched_off.append(p)

    def _switch_back(self) -> None:
        for p in self._switched_off:
            p.requires_grad_(True)
        self._switched_off = []

    def _before_layer(self, module: nn.Module, args: tuple) -> None:
        if self._replaying or not torch.is_grad_enabled():
            return
        if not args or not isinstance(args[0], torch.Tensor):
            return
        trained = self._first_call(
            module,
            type(module).__name__,
            "book-keeping supports one call per layer (use hooks or ew)",
        )
        if not trained:
            return
        x = args[0]
        self._refuse_folded_rows(module, x)
        if x.requires_grad:  # the gradient still reaches this layer's output through x
            self._switch_off(trained)
        self.records[module] = LayerRecord(module, x.detach(), trained)

    def _refuse_folded_rows(self, module: nn.Module, x: torch.Tensor) -> None:
        """A closed form's rows are its examples: a layer fed the batch folded with something
        else (`x.reshape(B * k, d)`: windows, tokens flattened into rows) would be clipped per
        row, and one example could move the release by k times the bound. Checked on every
        recorded call, self-test or not."""
        if self._rows is None or (x.dim() > 0 and x.shape[0] == self._rows):
            return
        name = next((n for n, m in self._module.named_modules() if m is module), "?")
        raise folded_rows_error(
            f"grad_sample_mode 'bk': module {name or '<root>'!r} ({type(module).__name__}) is "
            f"fed an input of shape {tuple(x.shape)}",
            self._rows,
        )

    def _after_layer(self, module: nn.Module, args: tuple, output: torch.Tensor) -> Any:
        if self._replaying:
            return
        rec = self.records.get(module)
        if rec is None or not isinstance(output, torch.Tensor) or not output.requires_grad:
            return
        assert isinstance(rec, LayerRecord)
        if not torch.compiler.is_compiling():  # autograd's saved tensors: eager only
            rules.forward_saved(rec, output)
            if self.fuse_norms and norm_fusion.fusable(module, args[0], output, rec.saved):
                return norm_fusion.fused_output(rec, args[0], output, self._norm_weights)
        return self._keep_grad(rec, output)

    def _keep_grad(self, rec: LayerRecord | FuncRecord, t: torch.Tensor) -> torch.Tensor | None:
        """Have the backward leave `t`'s gradient in `rec.g`; a tensor to use instead of `t`
        (None: `t` itself). The compiled forward (`compiled`) adds a tap instead."""

        def keep(grad: torch.Tensor) -> None:
            rec.g = grad.detach()

        t.register_hook(keep)
        return None

    def _before_func(self, name: str):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if self._replaying or not torch.is_grad_enabled():
                return
            what = f"{name or '<root>'} ({type(module).__name__})"
            trained = self._first_call(
                module, what, "book-keeping supports one call per module with trained parameters"
            )
            if not trained:
                return
            if mixes_examples(module):
                raise RuntimeError(
                    f"grad_sample_mode 'bk': {what} is a BatchNorm in training mode; its output "
                    "mixes the examples of a batch (eval mode uses its running statistics)"
                )
            leaves = [v for v in tree_leaves((args, kwargs)) if torch.is_tensor(v)]
            if any(v.requires_grad for v in leaves):  # its output gets a gradient through them
                self._switch_off(trained)
            args, kwargs = tree_map(detached, (args, kwargs))
            self.records[module] = FuncRecord(module, name, args, kwargs, trained)

        return hook

    def _before_tokens(self, name: str, layout: TokenLayout):
        def hook(module: nn.Module, args: tuple) -> None:
            if self._replaying or not torch.is_grad_enabled():
                return
            what = f"{name or '<root>'} ({type(module).__name__})"
            trained = self._first_call(module, what, "book-keeping supports one call per model")
            if trained:
                self.records[module] = FuncRecord(
                    module, name, (), {}, trained, strategy="closed form (tokens)", tokens=layout
                )

        return hook

    def _at_tokens(self, owner: nn.Module):
        """At `pos_drop`'s input (the tokens' sum): the output gradient of `_pos_embed`."""

        def hook(module: nn.Module, args: tuple) -> tuple | None:
            rec = self.records.get(owner)
            if self._replaying or not isinstance(rec, FuncRecord) or rec.tokens is None:
                return
            x = args[0]
            self._refuse_folded_rows(owner, x)
            rec.n = x.shape[0]
            if x.requires_grad:
                tapped = self._keep_grad(rec, x)
                return None if tapped is None else (tapped, *args[1:])

        return hook

    def _after_func(self, name: str):
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
            if self._replaying:
                return
            rec = self.records.get(module)
            if not isinstance(rec, FuncRecord):
                return
            what = f"{name or '<root>'} ({type(module).__name__})"
            if not isinstance(output, torch.Tensor):
                raise RuntimeError(
                    f"grad_sample_mode 'bk': {what} owns trained parameters and returns "
                    f"{type(output).__name__}, not a tensor; its per-example gradients need one "
                    "batch-first output tensor"
                )
            if output.dim() == 0 or output.shape[0] != self._rows:
                raise RuntimeError(
                    f"grad_sample_mode 'bk': {what} returns shape {tuple(output.shape)}, not "
                    f"batch-first for a batch of {self._rows}"
                )
            rec.n = output.shape[0]
            if output.requires_grad:
                return self._keep_grad(rec, output)

        return hook

    def clear(self) -> None:
        self.records = {}
        self._arenas = []

    def _close(self) -> None:
        """Drop the hooks (the finetune stage evaluates the plain module afterwards)."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self.records = {}
        self._arenas = []

    def batch_size(self) -> int | None:
        for rec in self.records.values():
            return rec.n
        return None

    def _complete(self, params: list[nn.Parameter]) -> list[LayerRecord]:
        recs = list(self.records.values())
        covered = {id(p) for r in recs for p in r.params.values()}
        missing = [p for p in params if id(p) not in covered]
        if missing:
            raise RuntimeError(
                f"grad_sample_mode 'bk': {len(missing)} trained parameter(s) were not used in the "
                "last forward (or it ran without gradients)"
            )
        if any(r.g is None for r in recs):
            raise RuntimeError("grad_sample_mode 'bk': clipping before the backward pass")
        for r in recs:  # autocast's bf16/fp16 records: norms and sums from one fp32 copy
            _full_precision(r)
        return recs

    def recorded_finite(self) -> bool:
        """Whether the last forward/backward recorded only finite values (fp16 overflow)."""
        flags = [
            torch.isfinite(t).all()
            for r in self.records.values()
            for t in (*(r.args if isinstance(r, FuncRecord) else (r.a,)), r.g)
            if isinstance(t, torch.Tensor) and t.is_floating_point()
        ]
        return bool(torch.stack(flags).all()) if flags else True

    # --- norms and clipped sums --------------------------------------------------------------
    @torch.no_grad()
    def per_sample_norms(self, params: list[nn.Parameter]) -> torch.Tensor:
        """L2 norm of each example's gradient over `params` (the last batch's trained layers).

        Per-example gradients small enough (`keep_elements` per layer) are kept for the sum.
        """
        recs = self._complete(params)
        wanted = {id(p) for p in params}
        # a subset of the layers (the per-sample self-test, module by module)
        taken = [r for r in recs if any(id(p) in wanted for p in r.params.values())]
        norms = self._norms(taken, wanted, self._loss_scale(recs[0]))
        if not self.last_plan:
            names = {m: n for n, m in self._module.named_modules()}
            self.last_plan = {(names.get(r.module, "?") or "<root>"): r.strategy for r in recs}
        return norms

    def _norms(self, taken: list, wanted: set[int], scale: float) -> torch.Tensor:
        """The norms from the records' rules, each layer's parts summed (`compiled` compiles
        this phase)."""
        parts: list = []
        # ghost norms of layers with one Gram shape, a product and a sum per group (`ghost`)
        settings = self._settings
        ghosts = rules.ghost_groups(taken, wanted, settings)
        settings = replace(settings, ghosts=ghosts)
        for rec in taken:
            if isinstance(rec, FuncRecord):
                parts += functional.func_norms_sq(rec, wanted, self.keep_elements, self._replay)
            else:
                parts += rules.layer_norms_sq(rec, wanted, settings)
        parts = ghosts.resolve(parts)
        # the kept gradients' norms in one reduction, their sums later in one product (`arena`)
        self._arenas = arena.gather(taken, self._loss_scale, self.workspace)
        parts += [a.norms_sq() for a in self._arenas]
        if not parts:  # not `assert parts`: Dynamo traces this phase again for an assert on a list
            raise RuntimeError("bk: no layer holds a wanted parameter")
        total = parts[0] if len(parts) == 1 else torch.stack(parts).sum(0)
        return total.sqrt() * scale

    @torch.no_grad()
    def clipped_sums(
        self, params: list[nn.Parameter], factor: torch.Tensor
    ) -> dict[int, torch.Tensor]:
        """`sum_i factor_i * grad_i` for each parameter (keyed by id), layer by layer; the kept
        gradients' from their arenas (one product each)."""
        return self._sums({id(p) for p in params}, factor)

    def _sums(self, wanted: set[int], factor: torch.Tensor) -> dict[int, torch.Tensor]:
        """`clipped_sums`' phase from the records (`compiled` compiles it)."""
        out: dict[int, torch.Tensor] = {}
        weights: dict[float, torch.Tensor] = {}  # one product per loss scale, not per layer

        def weighted(scale: float) -> torch.Tensor:
            if scale not in weights:
                weights[scale] = factor * scale
            return weights[scale]

        for a in self._arenas:
            out.update({k: v for k, v in a.sums(weighted(a.scale)).items() if k in wanted})
        rest = wanted - set(out)
        for rec in self.records.values():
            w = weighted(self._loss_scale(rec))
            if isinstance(rec, FuncRecord):
                out.update(functional.func_sums(rec, w, rest, self._replay))
            else:
                out.update(rules.layer_sums(rec, w, rest))
        return out

    def _loss_scale(self, rec: LayerRecord | FuncRecord) -> float:
        """Opacus' 'mean' convention: an example's gradient is that of its own loss; fp16's
        loss scale divided out (so the clip bound is on the true gradient)."""
        n = rec.n if self.loss_reduction == "mean" else 1
        return n if self.grad_scale == 1.0 else n / self.grad_scale

    @property
    def _settings(self) -> rules.Settings:
        return rules.Settings(self.keep_elements, self.strategy, self.workspace, self.launch_bound)

    @contextlib.contextmanager
    def _replay(self) -> Iterator[None]:
        """torch.func runs a recorded module's forward again (`functional`): record nothing."""
        self._replaying = True
        try:
            yield
        finally:
            self._replaying = False


def _full_precision(rec: LayerRecord | FuncRecord) -> None:
    """Autocast's low-precision records in their parameters' dtype, before any norm is taken
    (a torch.func record's inputs too: its module is replayed outside autocast)."""
    dtype = next(iter(rec.params.values())).dtype

    def up(v: Any) -> Any:
        low = isinstance(v, torch.Tensor) and v.dtype in (torch.bfloat16, torch.float16)
        return v.to(dtype) if low else v

    if isinstance(rec, FuncRecord):
        rec.args = tuple(up(v) for v in rec.args)
        rec.kwargs = {k: up(v) for k, v in rec.kwargs.items()}
    else:
        rec.a = up(rec.a)
    rec.g = up(rec.g)
