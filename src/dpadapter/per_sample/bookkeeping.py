"""Book-keeping per-sample clipping (`finetune.grad_sample_mode: bk`), written by hand.

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

The result is Opacus' `clip_and_accumulate` to float tolerance (tests/privacy/
test_bookkeeping.py against a per-example loop, and the algorithm suite in bk mode): the same
clip factor `min(1, C / (|g_i| + 1e-6))`, the same `summed_grad`, so Opacus' noise, scaling,
virtual steps and every algorithm's phases run unchanged on top. Algorithms that read the
per-example gradients themselves (GEP's projection) declare `needs_per_sample_gradients`;
for them `bk` runs Opacus' hooks mode, since their cost is in the gradients this avoids.

Numerics on CUDA: the norms (step 2) and the clipped sum (step 3) come from different kernels
(a Gram product or a per-example gradient against one weight-gradient kernel). Under TF32 their
inputs are rounded differently, and a clipped example's contribution to the sum could exceed C
by ~1e-3 relative, i.e. more than the sensitivity the accountant is told. The optimizer's
clipping therefore runs in full FP32 (`dpadapter.device.full_fp32`: TF32 off for matmuls and
cuDNN convolutions, the previous flags restored afterwards), so both agree to FP32 rounding as
on the CPU; the model's forward and backward keep TF32 (config `tf32`). Clipping at a reduced
bound was the alternative; it would need a proven bound on TF32's error for every kernel.

Closed forms: Linear (any leading dims), Conv2d (zeros padding, any groups, stride,
dilation), GroupNorm, LayerNorm, each only where its class keeps the base class' forward (timm's
LayerNorm2d normalises over channels with a forward of its own), and a timm ViT's own tokens
(`cls_token`, `reg_token`, `pos_embed`: slices of the gradient where `_pos_embed` adds them,
`tokens`). Every other module that owns trainable parameters (LayerScale, an eval-mode
BatchNorm or any frozen-statistics norm, a padded Conv2d subclass, an Embedding) records its
call's arguments and its output gradient in the same forward/backward, and its per-example
gradients come from torch.func, for that module's own parameters only (`functional`): mixed
with the closed forms, so that any model trains under bk. Such a module keeps its parameters'
gradients switched off like the closed-form layers do when an input already needs one.

Refused, naming the module, because the result would be wrong: a module with trained
parameters called twice in one forward, a BatchNorm in training mode (its output mixes the
examples of the batch), a fallback module whose output is not one batch-first tensor, and a
fallback forward that draws random numbers (dropout inside it: the replay would draw others).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from opacus.optimizers import DPOptimizer
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

from dpadapter.device import full_fp32
from dpadapter.per_sample.clip import clip_factors
from dpadapter.per_sample.functional import module_grads
from dpadapter.per_sample.tokens import TokenLayout, token_layout

SUPPORTED_LAYERS: tuple[type[nn.Module], ...] = (nn.Linear, nn.Conv2d, nn.GroupNorm, nn.LayerNorm)


def closed_form(m: nn.Module) -> bool:
    """Whether bk's closed forms fit `m`: a supported class with that class' own forward."""
    base = next((t for t in SUPPORTED_LAYERS if isinstance(m, t)), None)
    if base is None or type(m).forward is not base.forward:
        return False
    if isinstance(m, nn.Conv2d):
        return m.padding_mode == "zeros" and not isinstance(m.padding, str)
    return True


def _owns_parameters(m: nn.Module) -> bool:
    return any(True for _ in m.parameters(recurse=False))


def unsupported_trainable(model: nn.Module, trainable_only: bool = True) -> list[str]:
    """Names of modules holding (trainable) parameters that book-keeping cannot clip.

    Only a BatchNorm in training mode (it mixes the examples); every other module is clipped,
    by a closed form or by torch.func (module docstring).
    """
    out = []
    for name, m in model.named_modules():
        own = list(m.parameters(recurse=False))
        if trainable_only:
            own = [p for p in own if p.requires_grad]
        if own and _mixes_examples(m):
            out.append(f"{name or '<root>'} ({type(m).__name__} in training mode)")
    return out


def _mixes_examples(m: nn.Module) -> bool:
    return isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training


def _refuse_unsupported(model: nn.Module) -> None:
    bad = unsupported_trainable(model)
    if bad:
        raise ValueError(
            "grad_sample_mode 'bk' cannot clip the trainable parameters of: "
            + ", ".join(bad)
            + " (its output mixes the examples of a batch; put it in eval mode to use its "
            "running statistics, or replace it by GroupNorm)"
        )


@dataclass
class _Record:
    """One layer's forward input and output gradient for the current physical batch."""

    module: nn.Module
    a: torch.Tensor
    params: dict[str, nn.Parameter] = field(default_factory=dict)  # "weight"/"bias" -> trained
    g: torch.Tensor | None = None
    strategy: str = ""  # how its norms were computed: exact, ghost, per-example(-im2col)
    kept: dict[int, torch.Tensor] = field(default_factory=dict)  # per-example grads for the sum

    @property
    def n(self) -> int:
        return self.a.shape[0]


@dataclass
class _FuncRecord:
    """A module without a closed form: its call's arguments and output gradient (torch.func)."""

    module: nn.Module
    name: str
    args: tuple
    kwargs: dict[str, Any]
    params: dict[str, nn.Parameter]
    n: int = 0
    g: torch.Tensor | None = None
    strategy: str = "torch.func"
    kept: dict[int, torch.Tensor] = field(default_factory=dict)
    tokens: TokenLayout | None = None  # a ViT's own tokens: a closed form, no replay (tokens)


class BookKeepingModule(nn.Module):
    """Wraps a model: records (input, output gradient) of every trainable layer per batch.

    `loss_reduction` "mean" (Opacus' convention) scales the output gradients by the physical
    batch size, so that per-example gradients are those of each example's own loss.
    """

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
        _refuse_unsupported(module)
        self._module = module
        self.loss_reduction = loss_reduction
        # Per-example gradients of a layer up to this many elements (64 MiB in float32) are
        # kept between the norms and the clipped sum; larger ones are recomputed as one
        # weight-gradient kernel on the clip-weighted output gradients.
        self.keep_elements = keep_elements
        # "auto": per layer, the cheaper of ghost norm and per-example gradient (see
        # _conv_weight_norms_sq); "ghost" / "per-example" force one (tests, benchmarks).
        if strategy not in ("auto", "ghost", "per-example"):
            raise ValueError(f"strategy must be auto, ghost or per-example, not {strategy!r}")
        self.strategy = strategy
        self.last_plan: dict[str, str] = {}  # layer -> how its norms were computed (first batch)
        # Reused patch buffers for ghost norms, one per shape: a fresh tens-of-MB allocation
        # each step costs its page faults on the CPU (measured 13 ms vs 4 ms for a 38 MB copy).
        self.workspace: dict[tuple, torch.Tensor] = {}
        self.records: dict[nn.Module, _Record | _FuncRecord] = {}
        # fp16's loss scale of the last backward (per_sample.precision); 1 otherwise
        self.grad_scale = 1.0
        self._switched_off: list[nn.Parameter] = []
        self._rows: int | None = None  # the batch size of the current forward
        self._replaying = False  # torch.func runs a module's forward again: record nothing
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
            _refuse_unsupported(self._module)  # a strategy may have unfrozen another layer
            first = next((a for a in tree_leaves((args, kwargs)) if torch.is_tensor(a)), None)
            self._rows = None if first is None or first.dim() == 0 else first.shape[0]
        try:
            return self._module(*args, **kwargs)
        finally:
            for p in self._switched_off:
                p.requires_grad_(True)
            self._switched_off = []

    def _first_call(self, module: nn.Module, what: str, hint: str) -> dict[str, nn.Parameter]:
        """The module's trained parameters; a second call in one forward is refused (checked
        first: after the first call its parameters may be switched off)."""
        if module in self.records:
            raise RuntimeError(
                f"grad_sample_mode 'bk': {what} is called twice in one forward; {hint}"
            )
        return {n: p for n, p in module.named_parameters(recurse=False) if p.requires_grad}

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
        if x.requires_grad:  # the gradient still reaches this layer's output through x
            for p in trained.values():
                p.requires_grad_(False)
                self._switched_off.append(p)
        self.records[module] = _Record(module, x.detach(), trained)

    def _after_layer(self, module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        if self._replaying:
            return
        rec = self.records.get(module)
        if rec is None or not isinstance(output, torch.Tensor) or not output.requires_grad:
            return

        def keep(grad: torch.Tensor) -> None:
            rec.g = grad.detach()

        output.register_hook(keep)

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
            if _mixes_examples(module):
                raise RuntimeError(
                    f"grad_sample_mode 'bk': {what} is a BatchNorm in training mode; its output "
                    "mixes the examples of a batch (eval mode uses its running statistics)"
                )
            leaves = [v for v in tree_leaves((args, kwargs)) if torch.is_tensor(v)]
            if any(v.requires_grad for v in leaves):  # its output gets a gradient through them
                for p in trained.values():
                    p.requires_grad_(False)
                    self._switched_off.append(p)
            args, kwargs = tree_map(_detached, (args, kwargs))
            self.records[module] = _FuncRecord(module, name, args, kwargs, trained)

        return hook

    def _before_tokens(self, name: str, layout: TokenLayout):
        def hook(module: nn.Module, args: tuple) -> None:
            if self._replaying or not torch.is_grad_enabled():
                return
            what = f"{name or '<root>'} ({type(module).__name__})"
            trained = self._first_call(module, what, "book-keeping supports one call per model")
            if trained:
                self.records[module] = _FuncRecord(
                    module, name, (), {}, trained, strategy="closed form (tokens)", tokens=layout
                )

        return hook

    def _at_tokens(self, owner: nn.Module):
        """At `pos_drop`'s input (the tokens' sum): the output gradient of `_pos_embed`."""

        def hook(module: nn.Module, args: tuple) -> None:
            rec = self.records.get(owner)
            if self._replaying or not isinstance(rec, _FuncRecord) or rec.tokens is None:
                return
            x = args[0]
            rec.n = x.shape[0]
            if x.requires_grad:

                def keep(grad: torch.Tensor) -> None:
                    rec.g = grad.detach()

                x.register_hook(keep)

        return hook

    def _after_func(self, name: str):
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            if self._replaying:
                return
            rec = self.records.get(module)
            if not isinstance(rec, _FuncRecord):
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
            if not output.requires_grad:
                return

            def keep(grad: torch.Tensor) -> None:
                rec.g = grad.detach()

            output.register_hook(keep)

        return hook

    def clear(self) -> None:
        self.records = {}

    def _close(self) -> None:
        """Drop the hooks (the finetune stage evaluates the plain module afterwards)."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self.records = {}

    def batch_size(self) -> int | None:
        for rec in self.records.values():
            return rec.n
        return None

    def _complete(self, params: list[nn.Parameter]) -> list[_Record]:
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
            for t in (*(r.args if isinstance(r, _FuncRecord) else (r.a,)), r.g)
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
        total = None
        for rec in recs:
            if not any(id(p) in wanted for p in rec.params.values()):
                continue  # a subset of the layers (the per-sample self-test, module by module)
            if isinstance(rec, _FuncRecord):
                sq = self._func_norms_sq(rec, wanted)
            else:
                sq = _layer_norms_sq(rec, wanted, self.keep_elements, self.strategy, self.workspace)
            total = sq if total is None else total + sq
        assert total is not None
        if not self.last_plan:
            names = {m: n for n, m in self._module.named_modules()}
            self.last_plan = {(names.get(r.module, "?") or "<root>"): r.strategy for r in recs}
        return total.sqrt() * self._loss_scale(recs[0])

    @torch.no_grad()
    def clipped_sums(
        self, params: list[nn.Parameter], factor: torch.Tensor
    ) -> dict[int, torch.Tensor]:
        """`sum_i factor_i * grad_i` for each parameter (keyed by id), layer by layer."""
        out: dict[int, torch.Tensor] = {}
        wanted = {id(p) for p in params}
        for rec in self.records.values():
            weights = factor * self._loss_scale(rec)
            if isinstance(rec, _FuncRecord):
                out.update(self._func_sums(rec, weights, wanted))
            else:
                out.update(_layer_sums(rec, weights, wanted))
        return out

    def _loss_scale(self, rec: _Record | _FuncRecord) -> float:
        """Opacus' 'mean' convention: an example's gradient is that of its own loss; fp16's
        loss scale divided out (so the clip bound is on the true gradient)."""
        n = rec.n if self.loss_reduction == "mean" else 1
        return n if self.grad_scale == 1.0 else n / self.grad_scale

    def _func_grads(self, rec: _FuncRecord, wanted: set[int]) -> dict[int, torch.Tensor]:
        """{id(p): (n, *p.shape)} for the wanted parameters of a module without a closed form."""
        assert rec.g is not None
        params = {k: p.detach() for k, p in rec.params.items() if id(p) in wanted}
        if not params:
            return {}
        if rec.tokens is not None:
            grads = rec.tokens.grads(rec.g, params)
            return {id(rec.params[k]): v for k, v in grads.items()}
        self._replaying = True
        try:
            grads = module_grads(rec.module, params, rec.args, rec.kwargs, rec.g)
        except RuntimeError as e:
            if "random" not in str(e):
                raise
            raise RuntimeError(
                f"grad_sample_mode 'bk': {rec.name or '<root>'} ({type(rec.module).__name__}) "
                "draws random numbers in its forward (dropout?), which its per-example "
                f"gradients cannot replay: {e}"
            ) from e
        finally:
            self._replaying = False
        return {id(rec.params[k]): v for k, v in grads.items()}

    def _func_norms_sq(self, rec: _FuncRecord, wanted: set[int]) -> torch.Tensor:
        rec.kept = {}
        total = None
        for pid, grads in self._func_grads(rec, wanted).items():
            if grads.numel() <= self.keep_elements:
                rec.kept[pid] = grads
            sq = grads.reshape(grads.shape[0], -1).pow(2).sum(1)
            total = sq if total is None else total + sq
        assert total is not None
        return total

    def _func_sums(
        self, rec: _FuncRecord, weights: torch.Tensor, wanted: set[int]
    ) -> dict[int, torch.Tensor]:
        todo = {id(p) for p in rec.params.values() if id(p) in wanted and id(p) not in rec.kept}
        fresh = self._func_grads(rec, todo) if todo else {}
        out = {}
        for p in rec.params.values():
            grads = rec.kept.get(id(p), fresh.get(id(p)))
            if id(p) in wanted and grads is not None:
                out[id(p)] = torch.tensordot(weights.to(grads.dtype), grads, dims=1)
        return out


def _detached(v: Any) -> Any:
    return v.detach() if isinstance(v, torch.Tensor) else v


def _full_precision(rec: _Record | _FuncRecord) -> None:
    """Autocast's low-precision records in their parameters' dtype, before any norm is taken
    (a torch.func record's inputs too: its module is replayed outside autocast)."""
    dtype = next(iter(rec.params.values())).dtype

    def up(v: Any) -> Any:
        low = isinstance(v, torch.Tensor) and v.dtype in (torch.bfloat16, torch.float16)
        return v.to(dtype) if low else v

    if isinstance(rec, _FuncRecord):
        rec.args = tuple(up(v) for v in rec.args)
        rec.kwargs = {k: up(v) for k, v in rec.kwargs.items()}
    else:
        rec.a = up(rec.a)
    rec.g = up(rec.g)


def _layer_norms_sq(
    rec: _Record, wanted: set[int], keep: int, strategy: str, workspace: dict[tuple, torch.Tensor]
) -> torch.Tensor:
    """Squared per-example gradient norm of one layer's trained parameters (n,)."""
    module, a, g = rec.module, rec.a, rec.g
    assert g is not None
    n = g.shape[0]
    w, b = rec.params.get("weight"), rec.params.get("bias")
    want_w = w is not None and id(w) in wanted
    want_b = b is not None and id(b) in wanted
    parts: list[torch.Tensor] = []
    rec.kept = {}
    if isinstance(module, nn.Linear) and a.dim() == 2:
        rec.strategy = "exact"
        g2 = g.pow(2).sum(1)
        if want_w:
            parts.append(g2 * a.pow(2).sum(1))
        if want_b:
            parts.append(g2)
    elif isinstance(module, nn.Linear):
        a3, g3 = a.reshape(n, -1, a.shape[-1]), g.reshape(n, -1, g.shape[-1])
        t, d, p = a3.shape[1], a3.shape[2], g3.shape[2]
        if want_w:
            if strategy == "ghost" or (strategy == "auto" and t * (d + p) < d * p):
                rec.strategy = "ghost"
                parts.append(_ghost(a3, g3.transpose(1, 2)))
            else:
                rec.strategy = "per-example"
                grads = torch.bmm(g3.transpose(1, 2), a3)  # (n, p, d)
                parts.append(_keep(rec, w, grads, keep))
        if want_b:
            parts.append(_keep(rec, b, g3.sum(1), keep))
    elif isinstance(module, nn.Conv2d):
        if want_w:
            parts.append(_conv_weight_norms_sq(module, rec, w, keep, strategy, workspace))
        if want_b:
            parts.append(_keep(rec, b, g.sum(dim=(2, 3)), keep))
    else:
        rec.strategy = "per-example"
        gw, gb = _norm_layer_grads(module, a, g)
        if want_w:
            parts.append(_keep(rec, w, gw, keep))
        if want_b:
            parts.append(_keep(rec, b, gb, keep))
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total


def _keep(rec: _Record, p: torch.Tensor, grads: torch.Tensor, keep: int) -> torch.Tensor:
    """Squared norms of per-example gradients `grads`; kept for the sum if small enough."""
    if grads.numel() <= keep:
        rec.kept[id(p)] = grads
    return grads.reshape(grads.shape[0], -1).pow(2).sum(1)


def _ghost(a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """|g_i^T a_i|_F^2 for a (n, T, d), g (n, p, T) via T x T Gram matrices (Li et al. 2022)."""
    return (torch.bmm(a, a.transpose(1, 2)) * torch.bmm(g.transpose(1, 2), g)).sum(dim=(1, 2))


def _conv_weight_norms_sq(
    module: nn.Conv2d,
    rec: _Record,
    w: torch.Tensor,
    keep: int,
    strategy: str,
    workspace: dict[tuple, torch.Tensor],
) -> torch.Tensor:
    """A Conv2d weight's per-example norms: ghost norm or per-example gradients, the cheaper.

    With T output positions, d = Cin/G*kh*kw inputs and p = Cout/G outputs per group, the ghost
    norm costs T^2 (d + p) and the per-example gradient T d p per example and group. The ghost
    norm is taken (groups 1 only) when it is cheaper by that count with a factor 1.5 in its
    favour: its two Gram products are large matrix products, whereas the per-example gradients
    come from a grouped convolution (one group per example and conv group) that writes n d p
    values, which on this CPU ran 4x below its FLOP rate where T is small and the channels many
    (ResNet20's 64-channel 8x8 convolutions: 44 ms grouped vs 14-25 ms ghost at batch 256;
    the embedded CNN's 16->32 7x7 one: 0.8 ms grouped vs 1.8 ms ghost; /tmp measurements
    recorded in docs/speed.md). The rule is a heuristic from these CPU figures.
    """
    a, g = rec.a, rec.g
    assert g is not None
    n, c_in = a.shape[:2]
    c_out, t = g.shape[1], g.shape[2] * g.shape[3]
    groups = module.groups
    d = c_in // groups * module.kernel_size[0] * module.kernel_size[1]
    p = c_out // groups
    cheaper = t * (d + p) < 1.5 * d * p
    if groups == 1 and (strategy == "ghost" or (strategy == "auto" and cheaper)):
        rec.strategy = "ghost"
        return _ghost(_patches(module, a, workspace), g.reshape(n, c_out, t))
    if groups == 1 and c_in <= IM2COL_MAX_IN_CHANNELS:
        rec.strategy = "per-example-im2col"
        grads = _conv_per_example_im2col(module, a, g, workspace)
    else:
        rec.strategy = "per-example"
        grads = _conv_per_example_grouped(module, a, g, w)
    return _keep(rec, w, grads, keep)


# Per-example gradients of an ungrouped conv with up to this many input channels come from
# im2col + a batched matrix product, of any other conv from the grouped weight-gradient kernel.
# Measured on this CPU (bench/conv_per_example.py, 2 threads, ms, grouped vs im2col + bmm,
# batch 256 unless said): 3->16 at 32x32 (ResNet20's stem) 17.8 vs 6.1; 4->16 at 28x28 9.5 vs
# 6.1; 1->64 (GNResNet-10's stem) 6.6 vs 6.7; 1->32 (DPNAS') 4.8 vs 3.5; 1->8, batch 200 (the
# embedded CNN's) 1.28 vs 0.62; but 8->16 at 14x14 0.68 vs 1.43 and depthwise 32 groups at
# 28x28 4.4 vs 34.4. The grouped kernel runs far below its FLOP rate when a group has few input
# channels; bmm does when the matrices are tiny (one output channel per group).
IM2COL_MAX_IN_CHANNELS = 4


def _conv_per_example_grouped(
    module: nn.Conv2d, a: torch.Tensor, g: torch.Tensor, w: torch.Tensor
) -> torch.Tensor:
    """(n, *w.shape): examples as groups, one grouped weight-gradient kernel for all of them."""
    n, c_in = a.shape[:2]
    c_out = g.shape[1]
    grads = _conv_weight_grad(
        module,
        g.reshape(1, n * c_out, *g.shape[2:]),
        a.reshape(1, n * c_in, *a.shape[2:]),
        w.new_empty(1).expand(n * c_out, *w.shape[1:]),  # only its shape is read
        n * module.groups,
    )
    return grads.reshape(n, *w.shape)


def _conv_per_example_im2col(
    module: nn.Conv2d,
    a: torch.Tensor,
    g: torch.Tensor,
    workspace: dict[tuple, torch.Tensor] | None = None,
) -> torch.Tensor:
    """(n, Cout, Cin/G, kh, kw): `g_i^T P_i` per example and group, P the input patches.

    The patches are laid out (n, Cin, kh, kw, T) by kh*kw strided slice copies (rows stay
    contiguous), which on this CPU is 8x faster than `F.unfold` for one input channel.
    """
    (kh, kw), (sh, sw), (dh, dw) = module.kernel_size, module.stride, module.dilation
    ph, pw = module.padding  # type: ignore[misc]
    n, c_in = a.shape[:2]
    c_out, ho, wo = g.shape[1:]
    groups = module.groups
    x = F.pad(a, (pw, pw, ph, ph))
    buf = _buffer(workspace, "im2col", (n, c_in, kh, kw, ho, wo), a)
    for i in range(kh):
        for j in range(kw):
            rows = slice(i * dh, i * dh + sh * (ho - 1) + 1, sh)
            cols = slice(j * dw, j * dw + sw * (wo - 1) + 1, sw)
            buf[:, :, i, j] = x[:, :, rows, cols]
    d = c_in // groups * kh * kw
    patches = buf.view(n * groups, d, ho * wo)
    out = torch.bmm(g.reshape(n * groups, c_out // groups, ho * wo), patches.transpose(1, 2))
    return out.reshape(n, c_out, c_in // groups, kh, kw)


def _conv_weight_grad(
    module: nn.Conv2d, g: torch.Tensor, a: torch.Tensor, weight: torch.Tensor, groups: int
) -> torch.Tensor:
    """The weight gradient of `module`'s convolution for output gradient g and input a."""
    return torch.ops.aten.convolution_backward(
        g,
        a,
        weight,
        None,
        module.stride,
        module.padding,
        module.dilation,
        False,
        [0, 0],
        groups,
        [False, True, False],
    )[1]


def _patches(
    module: nn.Conv2d, a: torch.Tensor, workspace: dict[tuple, torch.Tensor] | None = None
) -> torch.Tensor:
    """Input patches (n, T, kh*kw*Cin) copied from a channels-last view (contiguous rows).

    With a `workspace` the copy goes into a buffer kept there for the layout; the result is only
    valid until the next call with the same layout (ghost norms consume it at once).
    """
    (kh, kw), (sh, sw), (dh, dw) = module.kernel_size, module.stride, module.dilation
    ph, pw = module.padding  # type: ignore[misc]
    x = F.pad(a, (pw, pw, ph, ph)).contiguous(memory_format=torch.channels_last)
    v = x.unfold(2, dh * (kh - 1) + 1, sh).unfold(3, dw * (kw - 1) + 1, sw)
    v = v[..., ::dh, ::dw]  # (n, C, Ho, Wo, kh, kw)
    n, c, ho, wo = v.shape[:4]
    v = v.permute(0, 2, 3, 4, 5, 1)
    if workspace is None:
        return v.reshape(n, ho * wo, kh * kw * c)
    buf = _buffer(workspace, "patches", tuple(v.shape), a)
    return buf.copy_(v).view(n, ho * wo, kh * kw * c)


def _buffer(
    workspace: dict[tuple, torch.Tensor] | None,
    kind: str,
    shape: tuple[int, ...],
    like: torch.Tensor,
) -> torch.Tensor:
    """A contiguous (n, ...) tensor from a buffer kept per layout and grown to the largest n.

    Keyed without n: Poisson batches vary in size every step, and one buffer per size would
    keep dozens of them alive. The first n rows of the kept buffer are contiguous.
    """
    if workspace is None:
        return like.new_empty(shape)
    key = (kind, shape[1:], like.dtype, like.device)
    buf = workspace.get(key)
    if buf is None or buf.shape[0] < shape[0]:
        buf = workspace[key] = like.new_empty(shape)
    return buf[: shape[0]]


def _norm_layer_grads(module: nn.Module, a: torch.Tensor, g: torch.Tensor):
    """Per-example (weight, bias) gradients of GroupNorm (n, C) / LayerNorm (n, *shape)."""
    if isinstance(module, nn.GroupNorm):
        xhat = F.group_norm(a, module.num_groups, eps=module.eps)
        dims = tuple(range(2, a.dim()))
        return (xhat * g).sum(dim=dims), g.sum(dim=dims)
    assert isinstance(module, nn.LayerNorm)
    xhat = F.layer_norm(a, module.normalized_shape, eps=module.eps)
    lead = tuple(range(1, a.dim() - len(module.normalized_shape)))
    if not lead:
        return xhat * g, g
    return (xhat * g).sum(dim=lead), g.sum(dim=lead)


def _layer_sums(rec: _Record, weights: torch.Tensor, wanted: set[int]) -> dict[int, torch.Tensor]:
    """Weighted sums of one layer's per-example gradients (weights: clip factor x loss scale)."""
    module, a, g = rec.module, rec.a, rec.g
    assert g is not None
    out: dict[int, torch.Tensor] = {}
    for name, p in rec.params.items():
        if id(p) not in wanted:
            continue
        kept = rec.kept.get(id(p))
        if kept is not None:
            out[id(p)] = torch.tensordot(weights.to(kept.dtype), kept, dims=1)
            continue
        gw = g * weights.reshape(-1, *([1] * (g.dim() - 1))).to(g.dtype)
        if isinstance(module, nn.Linear):
            g2 = gw.reshape(-1, gw.shape[-1])
            out[id(p)] = g2.t() @ a.reshape(-1, a.shape[-1]) if name == "weight" else g2.sum(0)
        elif isinstance(module, nn.Conv2d) and name == "weight":
            out[id(p)] = _conv_weight_grad(module, gw, a, p, module.groups)
        elif isinstance(module, nn.Conv2d):
            out[id(p)] = gw.sum(dim=(0, 2, 3))
        else:
            gwt, gbt = _norm_layer_grads(module, a, gw)
            out[id(p)] = (gwt if name == "weight" else gbt).sum(0)
    return out


class BookKeepingClip:
    """Placed before an Opacus optimizer class: clipping from the module's records.

    Everything else (noise, scaling, virtual steps, step hooks, AdaClip's count through
    `observe_norms`) is the wrapped class's. Opacus reads `p.grad_sample` only to count
    accumulated physical batches and to spot empty ones; after clipping each parameter holds an
    empty `(n, 0)` marker there instead of its per-example gradients.
    """

    bookkeeping: BookKeepingModule

    @property
    def grad_samples(self) -> list[torch.Tensor]:
        n = self.bookkeeping.batch_size()
        if n is None:
            return super().grad_samples  # type: ignore[misc]
        return [_marker(p, n) for p in self.params]  # type: ignore[attr-defined]

    def clip_and_accumulate(self) -> None:
        """Norms, clip factors and clipped sums in full FP32: see the module docstring."""
        with full_fp32():
            self._clip_and_accumulate()

    def _clip_and_accumulate(self) -> None:
        params = self.params  # type: ignore[attr-defined]
        bk = self.bookkeeping
        n = bk.batch_size()
        if n is None:  # an empty Poisson batch: the algorithm set empty per-sample gradients
            for p in params:
                gs = getattr(p, "grad_sample", None)
                if gs is None or len(gs) != 0:
                    raise RuntimeError("grad_sample_mode 'bk': no forward/backward to clip")
            device = params[0].device if params else None
            norms = torch.zeros(0, device=device)
            sums = {id(p): torch.zeros_like(p) for p in params}
        else:
            norms = bk.per_sample_norms(params)
            sums = None
        factor = clip_factors(norms, self.max_grad_norm)  # type: ignore[attr-defined]
        observe = getattr(self, "observe_norms", None)
        if observe is not None:
            observe(norms)
        if sums is None:
            sums = bk.clipped_sums(params, factor)
        for p in params:
            s = sums[id(p)].to(p.dtype)
            prev = getattr(p, "summed_grad", None)
            p.summed_grad = s if prev is None else prev + s
            if getattr(p, "grad_sample", None) is None:
                p.grad_sample = _marker(p, n or 0)
        bk.clear()


def _marker(p: torch.Tensor, n: int) -> torch.Tensor:
    return torch.empty((n, 0), dtype=p.dtype, device=p.device)


_CLASSES: dict[type, type] = {}


def attach_bookkeeping(opt: DPOptimizer, module: BookKeepingModule) -> DPOptimizer:
    """Make `opt` (any DPOptimizer subclass) clip from `module`'s records, in place."""
    cls = type(opt)
    if not issubclass(cls, BookKeepingClip):
        if cls not in _CLASSES:
            _CLASSES[cls] = type(f"BookKeeping{cls.__name__}", (BookKeepingClip, cls), {})
        opt.__class__ = _CLASSES[cls]
    opt.bookkeeping = module  # type: ignore[attr-defined]
    return opt
