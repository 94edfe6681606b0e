"""Book-keeping's closed forms: one table from a layer type to its two rules.

For a layer with input `a` and output gradient `g` (recorded by `bookkeeping`), each rule
pair answers the two questions of the method (Bu et al. 2023), as fastDP's
`supported_layers_grad_samplers.py` table does:

- `norms_sq`: each example's squared gradient norm over the layer's trained parameters,
  by whichever is cheaper (mixed ghost clipping, `conv_norms_sq` says how it decides): the
  ghost norm `sum_ts (a_t . a_s)(g_t . g_s)` (T^2 (d + p) per example for T positions, d
  inputs, p outputs) or the per-example gradient `g^T a` (T d p), freed as soon as its norm is
  taken unless it is small enough to keep for the sum (`Settings.keep`). A Linear layer on
  flat inputs has the exact product `|g| |a|`; GroupNorm/LayerNorm per-example gradients are
  one value per channel.
- `clipped_sum`: `sum_i c_i g_i^T a_i` as one weight-gradient kernel on the clip-weighted
  output gradients (a matrix product for Linear, `convolution_backward` for Conv2d), so that
  per-example gradients are never stored for the whole model.

A module is clipped by its table entry only where its class keeps the base class' forward
(`closed_form`): timm's LayerNorm2d normalises over channels with a forward of its own, a
padded Conv2d subclass pads differently; those go to torch.func (`functional`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from dpadapter.per_sample import arena, conv
from dpadapter.per_sample.buffers import Workspace
from dpadapter.per_sample.ghost import GhostGroups, Pending, ghost


@dataclass
class LayerRecord:
    """One layer's forward input and output gradient for the current physical batch."""

    module: nn.Module
    a: torch.Tensor
    params: dict[str, nn.Parameter] = field(default_factory=dict)  # "weight"/"bias" -> trained
    g: torch.Tensor | None = None
    strategy: str = ""  # how its norms were computed: exact, ghost, per-example(-im2col)
    kept: dict[int, torch.Tensor] = field(default_factory=dict)  # per-example grads for the sum
    saved: tuple = ()  # what the layer's own forward computed and its rule reuses (`forward_saved`)
    # per-example (weight, bias) gradients its backward already computed (`norm_fusion`)
    per_example: tuple = ()

    @property
    def n(self) -> int:
        return self.a.shape[0]

    # The layer's table entry, looked up once per record, not in each phase of the step (set
    # at construction: Python 3.11's cached_property takes a lock, which a compiled forward's
    # trace cannot enter, `compiled`).
    rule: LayerRule | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.rule = rule_for(self.module)


@dataclass(frozen=True)
class Settings:
    """What the wrapping module chose for every layer's norms."""

    keep: int  # per-example gradients of a layer up to this many elements are kept for the sum
    strategy: str  # auto (the cheaper), ghost or per-example
    workspace: Workspace  # the buffer pool (`buffers`)
    # whether a kernel launch costs more than its arithmetic here (`conv_weight_norms_sq`):
    # None decides by the device of the layer's input (CUDA: yes); True/False force it (benches)
    launch_bound: bool | None = None
    # the norms phase's groups of ghost norms taken together (`ghost`); None: each alone
    ghosts: GhostGroups | None = None

    def launches_dominate(self, t: torch.Tensor) -> bool:
        return t.device.type == "cuda" if self.launch_bound is None else self.launch_bound


def keep(rec: LayerRecord, p: torch.Tensor, grads: torch.Tensor, limit: int) -> torch.Tensor | None:
    """`p`'s per-example gradients kept for the sum, or their squared norms (`arena.keep`)."""
    return arena.keep(rec.kept, id(p), grads, limit)


def ghost_norm(a: torch.Tensor, g: torch.Tensor, s: Settings) -> torch.Tensor | Pending:
    """A weight's ghost norm, alone or with the layers of its group (`ghost.GhostGroups`)."""
    return ghost(a, g) if s.ghosts is None else s.ghosts.norm(a, g)


# --- Linear (any leading dimensions) ---------------------------------------------------------
def linear_norms_sq(rec: LayerRecord, w, b, s: Settings) -> list[torch.Tensor | None]:
    a, g = rec.a, rec.g
    assert g is not None
    n = g.shape[0]
    parts: list[torch.Tensor | None] = []
    if a.dim() == 2:
        if w is None or n * g.shape[1] * a.shape[1] <= s.keep:
            # small enough to keep: the outer products g_i a_i^T in one kernel, their norms and
            # sums then with the other kept gradients' (`arena`), where the exact norm
            # |g_i| |a_i| below and a separate sum took eight kernels (issue 47)
            rec.strategy = "per-example"
            if w is not None:
                parts.append(keep(rec, w, torch.bmm(g.unsqueeze(2), a.unsqueeze(1)), s.keep))
            if b is not None:
                parts.append(keep(rec, b, g, s.keep))
            return parts
        rec.strategy = "exact"  # one position: |g_i^T a_i| = |g_i| |a_i|
        g2 = g.pow(2).sum(1)
        parts.append(g2 * a.pow(2).sum(1))
        if b is not None:
            parts.append(g2)
        return parts
    a3, g3 = a.reshape(n, -1, a.shape[-1]), g.reshape(n, -1, g.shape[-1])
    if w is not None:
        if linear_ghost_positions(rec, s) is not None:
            rec.strategy = "ghost"
            parts.append(ghost_norm(a3, g3.transpose(1, 2), s))
        else:
            rec.strategy = "per-example"
            grads = torch.bmm(g3.transpose(1, 2), a3)  # (n, p, d)
            parts.append(keep(rec, w, grads, s.keep))
    if b is not None:
        parts.append(keep(rec, b, g3.sum(1), s.keep))
    return parts


def linear_ghost_positions(rec: LayerRecord, s: Settings) -> int | None:
    """T if a Linear weight's norm is a ghost norm over T positions (leading dimensions), the
    cheaper where T (d + p) < d p; None for the per-example gradient or exact norm."""
    a, g = rec.a, rec.g
    assert g is not None
    if a.dim() == 2:
        return None
    d, p = a.shape[-1], g.shape[-1]
    t = a.numel() // (a.shape[0] * d)
    if s.strategy == "ghost" or (s.strategy == "auto" and t * (d + p) < d * p):
        return t
    return None


def linear_sum(module: nn.Module, name: str, p, a: torch.Tensor, gw: torch.Tensor):
    g2 = gw.reshape(-1, gw.shape[-1])
    return g2.t() @ a.reshape(-1, a.shape[-1]) if name == "weight" else g2.sum(0)


# --- Conv2d (zeros padding, any groups, stride, dilation) ------------------------------------
def conv_norms_sq(rec: LayerRecord, w, b, s: Settings) -> list[torch.Tensor | None]:
    parts: list[torch.Tensor | None] = []
    if w is not None:
        parts.append(conv_weight_norms_sq(rec.module, rec, w, s))  # type: ignore[arg-type]
    if b is not None:
        assert rec.g is not None
        parts.append(keep(rec, b, rec.g.sum(dim=(2, 3)), s.keep))
    return parts


def conv_weight_norms_sq(
    module: nn.Conv2d, rec: LayerRecord, w: torch.Tensor, s: Settings
) -> torch.Tensor | Pending | None:
    """A Conv2d weight's per-example norms: ghost norm or per-example gradients, the cheaper
    (None: the gradients are kept and their norms taken with the others', `keep`; a `Pending`
    ghost norm: taken with its group's, `ghost`). Which one: `conv_ghost_positions`.

    With T output positions, d = Cin/G*kh*kw inputs and p = Cout/G outputs per group, the ghost
    norm costs T^2 (d + p) and the per-example gradient T d p per example and group. The ghost
    norm is taken (groups 1 only) when it is cheaper by that count with a factor 1.5 in its
    favour: its two Gram products are large matrix products, whereas the per-example gradients
    come from a grouped convolution (one group per example and conv group) that writes n d p
    values, which on this CPU ran 4x below its FLOP rate where T is small and the channels many
    (ResNet20's 64-channel 8x8 convolutions: 44 ms grouped vs 14-25 ms ghost at batch 256;
    the embedded CNN's 16->32 7x7 one: 0.8 ms grouped vs 1.8 ms ghost; /tmp measurements
    recorded in docs/speed.md). The rule is a heuristic from these CPU figures.

    Where kernel launches dominate (a GPU at our users' sizes, issue 47; `Settings.launch_bound`)
    the count also takes in what each path costs after the norm: the ghost path's clipped sum is
    one more weight-gradient kernel (T d p) and six more launches per layer, whereas per-example
    gradients small enough to keep (`Settings.keep`) need none of their own, their norm and sum
    coming from the arena's two (2 d p): ghost when T^2 (d + p) + T d p < 1.5 T d p + 2 d p.
    There the per-example gradients come from im2col and one batched product, never the grouped
    kernel, which cuDNN runs group by group (`conv.per_example_grouped`).
    Not on the CPU: there it moved ResNet20-GN's 8x8 convolutions to the slow grouped kernel
    and its bk step from ~190 to ~245 ms (batch 64, docs/speed.md).
    """
    a, g = rec.a, rec.g
    assert g is not None
    n, c_in = a.shape[:2]
    launch_bound = s.launches_dominate(a)
    t = conv_ghost_positions(rec, s)
    if t is not None:
        rec.strategy = "ghost"
        g3 = g.reshape(n, g.shape[1], t)
        if launch_bound:  # patches from one kernel (`conv.columns`), (n, d, T) transposed
            return ghost_norm(conv.columns(module, a).transpose(1, 2), g3, s)
        return ghost_norm(conv.patches(module, a, s.workspace), g3, s)
    if launch_bound or (module.groups == 1 and c_in <= conv.IM2COL_MAX_IN_CHANNELS):
        rec.strategy = "per-example-im2col"
        grads = conv.per_example_im2col(module, a, g, s.workspace, one_kernel=launch_bound)
    else:
        rec.strategy = "per-example"
        grads = conv.per_example_grouped(module, a, g, w)
    return keep(rec, w, grads, s.keep)


def conv_ghost_positions(rec: LayerRecord, s: Settings) -> int | None:
    """T if a Conv2d weight's norm is a ghost norm over its T output positions (the cost
    model in `conv_weight_norms_sq`'s docstring); None for per-example gradients."""
    module, a, g = rec.module, rec.a, rec.g
    assert g is not None and isinstance(module, nn.Conv2d)
    n, c_in = a.shape[:2]
    c_out, t = g.shape[1], g.shape[2] * g.shape[3]
    groups = module.groups
    d = c_in // groups * module.kernel_size[0] * module.kernel_size[1]
    p = c_out // groups
    if s.launches_dominate(a) and n * groups * d * p <= s.keep:
        cheaper = t * t * (d + p) < 0.5 * t * d * p + 2 * d * p
    else:
        cheaper = t * t * (d + p) < 1.5 * t * d * p
    if groups == 1 and (s.strategy == "ghost" or (s.strategy == "auto" and cheaper)):
        return t
    return None


def conv_sum(module: nn.Module, name: str, p, a: torch.Tensor, gw: torch.Tensor):
    if name == "weight":
        return conv.weight_grad(module, gw, a, p, module.groups)  # type: ignore[arg-type]
    return gw.sum(dim=(0, 2, 3))


# --- GroupNorm, LayerNorm (per-example gradients: one value per channel) ---------------------
def group_norm_saved(module: nn.Module, output: torch.Tensor) -> tuple:
    """The forward's own mean and 1/std (n, G), as autograd saved them for GroupNorm's backward
    (`grad_fn._saved_result1/2`), so the norms need not normalise the input again; () where the
    output did not come from that kernel (`group_norm_grads` then recomputes them)."""
    fn = output.grad_fn
    if type(fn).__name__ != "NativeGroupNormBackward0":
        return ()
    try:
        mean, rstd = fn._saved_result1, fn._saved_result2
    except (AttributeError, RuntimeError):  # freed, or another build's attribute names
        return ()
    return (mean.detach(), rstd.detach())


def group_norm_grads(module: nn.GroupNorm, a: torch.Tensor, g: torch.Tensor, saved: tuple = ()):
    """Per-example (weight, bias) gradients (n, C) of a GroupNorm from one backward kernel
    (`group_norm_folded`), with the forward's (mean, 1/std) where it kept them."""
    n, c = a.shape[:2]
    hw = math.prod(a.shape[2:])
    stats = saved if saved and all(t.dtype == a.dtype for t in saved) else ()
    if not stats:
        stats = torch.ops.aten.native_group_norm(
            a, None, None, n, c, hw, module.num_groups, module.eps
        )[1:]
    _, gw, gb = group_norm_folded(module, a, g, stats)
    return gw, gb


def group_norm_folded(
    module: nn.GroupNorm,
    a: torch.Tensor,
    g: torch.Tensor,
    stats: tuple,
    weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """(input gradient, per-example weight and bias gradients (n, C)) of a GroupNorm from one
    backward kernel; the input gradient only when given the weight repeated per example
    (`norm_fusion`), else None.

    Folding the batch into the channels, (n, C, HW) -> (1, n C, HW) with n G groups, makes
    GroupNorm's own weight-gradient kernel, which sums over the batch, sum over one example
    only: `sum_hw g xhat` and `sum_hw g` per example and channel in one kernel, where
    normalising, multiplying and two sums took four (issue 47). Its formula is the one
    autograd's GroupNorm backward uses, `(sum g x - mean sum g) rstd`. `stats`: the forward's
    (mean, 1/std), (n, G).

    Its rounding (issue 66): that form cancels where a group's mean is large against its std,
    so in float32 an example's (weight, bias) gradient is off by about u (1 + |mean|/std) of
    its norm (u = 2^-24), ~5 u (1 + |mean|/std) for a nearly-zero per-example gradient;
    16 u (1 + |mean|/std) is the bound `tests/bench/test_gpu_gn_rounding.py` holds it to, for
    the CPU's kernel and for CUDA's float32 accumulation order (emulated on the CPU,
    `bench/gpu/gpu_gn_rounding.py`) alike. The centred form `sum g (x - mean) rstd` is left
    with ~u (1 + |mean|/std) (float32's own rounding of the mean), so the folded form costs at
    most ~5x the working dtype's conditioning, for a kernel fewer; at GNResNet-10's inputs
    (Table 2's, seed 0) |mean|/std stays below ~1 and every way is off by at most 3e-7.
    """
    n, c = a.shape[:2]
    hw = math.prod(a.shape[2:])
    groups = n * module.num_groups
    mean, rstd = (t.reshape(1, groups) for t in stats)
    input_grad = weight is not None
    if weight is None:
        # not read when no input gradient is asked for, but it must be given (a NaN weight
        # changes nothing on the CPU; on CUDA the CUDA tests of test_bookkeeping.py check it)
        weight = a.new_empty(1).expand(n * c)
    # contiguous: the kernel reads its operands as laid out contiguously, and a reshape of one
    # example's strided gradient (a GroupNorm's output transposed downstream, channels last) is
    # a strided view, where two or more examples' is a copy: wrong gradients at batch size 1
    dx, gw, gb = torch.ops.aten.native_group_norm_backward(
        g.reshape(1, n * c, hw).contiguous(), a.reshape(1, n * c, hw).contiguous(), mean, rstd,
        weight,
        1, n * c, hw, groups, [input_grad, True, True],
    )  # fmt: skip
    return (dx.view_as(a) if dx is not None else None), gw.view(n, c), gb.view(n, c)


def norm_layer_grads(module: nn.Module, a: torch.Tensor, g: torch.Tensor, saved: tuple = ()):
    """Per-example (weight, bias) gradients of GroupNorm (n, C) / LayerNorm (n, *shape)."""
    if isinstance(module, nn.GroupNorm):
        return group_norm_grads(module, a, g, saved)
    assert isinstance(module, nn.LayerNorm)
    xhat = F.layer_norm(a, module.normalized_shape, eps=module.eps)
    lead = tuple(range(1, a.dim() - len(module.normalized_shape)))
    if not lead:
        return xhat * g, g
    return (xhat * g).sum(dim=lead), g.sum(dim=lead)


def norm_layer_norms_sq(rec: LayerRecord, w, b, s: Settings) -> list[torch.Tensor | None]:
    assert rec.g is not None
    rec.strategy = "per-example"
    gw, gb = rec.per_example or norm_layer_grads(rec.module, rec.a, rec.g, rec.saved)
    parts: list[torch.Tensor | None] = []
    if w is not None:
        parts.append(keep(rec, w, gw, s.keep))
    if b is not None:
        parts.append(keep(rec, b, gb, s.keep))
    return parts


def norm_layer_sum(module: nn.Module, name: str, p, a: torch.Tensor, gw: torch.Tensor):
    gwt, gbt = norm_layer_grads(module, a, gw)
    return (gwt if name == "weight" else gbt).sum(0)


# --- the table ---------------------------------------------------------------------------------
class LayerRule(NamedTuple):
    # (record, weight or None, bias or None, settings) -> squared norms (n,), weight's first;
    # None for a parameter whose per-example gradients the rule kept (`keep`)
    norms_sq: Callable[..., list[torch.Tensor | None]]
    # (module, "weight"/"bias", parameter, input a, clip-weighted output gradient) -> the sum
    clipped_sum: Callable[..., torch.Tensor]
    # (module, output) -> what the forward computed that the norms reuse (`LayerRecord.saved`)
    forward_saved: Callable[..., tuple] | None = None
    # (record, settings) -> T if the weight's norm is a ghost norm over T positions, else None
    # (`ghost.GhostGroups.plan` sizes the groups from it before the first Gram)
    ghost_positions: Callable[..., int | None] | None = None


RULES: dict[type[nn.Module], LayerRule] = {
    nn.Linear: LayerRule(linear_norms_sq, linear_sum, ghost_positions=linear_ghost_positions),
    nn.Conv2d: LayerRule(conv_norms_sq, conv_sum, ghost_positions=conv_ghost_positions),
    nn.GroupNorm: LayerRule(norm_layer_norms_sq, norm_layer_sum, group_norm_saved),
    nn.LayerNorm: LayerRule(norm_layer_norms_sq, norm_layer_sum),
}
SUPPORTED_LAYERS: tuple[type[nn.Module], ...] = tuple(RULES)


def rule_for(m: nn.Module) -> LayerRule | None:
    """`m`'s entry in the table, if its class keeps that entry's own forward (`closed_form`)."""
    base = next((t for t in RULES if isinstance(m, t)), None)
    if base is None or type(m).forward is not base.forward:
        return None
    if isinstance(m, nn.Conv2d) and (m.padding_mode != "zeros" or isinstance(m.padding, str)):
        return None
    return RULES[base]


def closed_form(m: nn.Module) -> bool:
    """Whether bk's closed forms fit `m`: a supported class with that class' own forward."""
    return rule_for(m) is not None


def forward_saved(rec: LayerRecord, output: torch.Tensor) -> None:
    """Keep what the layer's forward computed that its rule reuses (its table entry says)."""
    rule = rec.rule
    if rule is not None and rule.forward_saved is not None:
        rec.saved = rule.forward_saved(rec.module, output)


def ghost_groups(records: list, wanted: set[int], s: Settings) -> GhostGroups:
    """The groups of the ghost norms `layer_norms_sq` will take for `records` (LayerRecords;
    others are passed over), in the order it takes them (`ghost`)."""
    positions = []
    for rec in records:
        rule = getattr(rec, "rule", None)
        w = rec.params.get("weight") if rule is not None else None
        if rule is None or rule.ghost_positions is None or w is None or id(w) not in wanted:
            continue
        t = rule.ghost_positions(rec, s)
        if t is not None:
            positions.append((rec.a, t))
    return GhostGroups.plan(positions, s.workspace)


def layer_norms_sq(rec: LayerRecord, wanted: set[int], s: Settings) -> list[torch.Tensor | Pending]:
    """Squared per-example gradient norms (n,) of one layer's wanted trained parameters, as
    parts to add; the parameters whose gradients are kept (`rec.kept`) are left out of them,
    and a ghost norm taken with its group's is `Pending` until `GhostGroups.resolve`."""
    rule = rec.rule
    assert rule is not None and rec.g is not None
    w, b = rec.params.get("weight"), rec.params.get("bias")
    rec.kept = {}
    parts = rule.norms_sq(
        rec,
        w if w is not None and id(w) in wanted else None,
        b if b is not None and id(b) in wanted else None,
        s,
    )
    return [part for part in parts if part is not None]


def layer_sums(
    rec: LayerRecord, weights: torch.Tensor, wanted: set[int]
) -> dict[int, torch.Tensor]:
    """Weighted sums of one layer's per-example gradients (weights: clip factor x loss scale)."""
    rule = rec.rule
    a, g = rec.a, rec.g
    assert rule is not None and g is not None
    out: dict[int, torch.Tensor] = {}
    gw = None  # the clip-weighted output gradient, one product for the layer's parameters
    for name, p in rec.params.items():
        if id(p) not in wanted:
            continue
        kept = rec.kept.get(id(p))
        if kept is not None:
            out[id(p)] = torch.tensordot(weights.to(kept.dtype), kept, dims=1)
            continue
        if gw is None:
            gw = g * weights.reshape(-1, *([1] * (g.dim() - 1))).to(g.dtype)
        out[id(p)] = rule.clipped_sum(rec.module, name, p, a, gw)
    return out
