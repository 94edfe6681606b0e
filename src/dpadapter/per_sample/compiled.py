"""Book-keeping with a compiled step and compiled rules (`finetune.compile`, issue 47 item 3).

Why: at the sizes our users train, a GPU step is bound by kernel launches (docs/gpu.md), and
`torch.compile` fuses the model's element-wise kernels (GroupNorm, activations, residual adds)
in the forward and in the backward AOTAutograd derives from it; `reduce-overhead` (and in
current torch `max-autotune`) also replays the forward's and backward's kernels as CUDA graphs,
never the rules' (`rules_compile_kwargs`). Three things are compiled: the wrapped model's
forward with book-keeping's recording hooks traced into it (their inputs `a` and output
gradients `g` come out of the compiled graphs exactly as from eager ones), and the per-layer
rules' two phases
(`rules`): the per-example norms from the records, and the clip-weighted sums, where a GPU's
remaining small kernels are (a ghost norm's product and sum, the kept gradients' squares and
sums, the parts' total). The clip factors between the two phases, the noise and the Poisson
sampling stay eager; the rules are deterministic functions of the records, so no compiled or
replayed graph ever holds a random draw of the mechanism (docs/privacy.md). The rules run
compiled for a training step's whole set of trained parameters in closed forms only
(`_whole_step`), otherwise as the base runs them.

Two phases of the base differ, because Dynamo cannot trace them (a graph break per layer):

- Switching weights off. Book-keeping switches a layer's weights' `requires_grad` off during
  its forward where the output's gradient flows on through the input anyway (no unclipped
  weight gradient is computed). Which ones follows from which parameters train and the input's
  shape, not from the data: a planning forward, eager, on the same inputs under a forked RNG
  and discarded, finds the switches, each recorded layer's trained parameters and each
  recorded output's shape (`_Plan`); the compiled forward switches the same parameters off
  before the call and restores them after, and its traced hooks read the plan.
- Keeping the output gradient. A tensor hook that stores `g` is a side effect the compiled
  backward cannot hold. Instead each recorded output gets a tap added, `out + z`, where `z` is
  a zero leaf tensor of the output's shape (one stored zero, expanded): adding zero changes no
  value, and autograd leaves d(loss)/dz = d(loss)/d(out) = `g` in `z.grad` from inside the
  compiled backward. The records take their `g` from the taps before the norms.

Every recording forward's output comes from the compiled graphs (the planning forward's is
discarded), so the wrap-time self-test (`self_test`) checks the compiled path itself.

Shapes: `dynamic=False`, one graph per physical batch shape. Training pads Poisson batches to
one size when compiling (`train.batching.padding`); the self-test adds its small odd batch; a
shape beyond Dynamo's cache limit runs eagerly (same result, slower).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from dpadapter.per_sample.bookkeeping import BookKeepingModule
from dpadapter.per_sample.rules import LayerRecord

# `finetune.compile`: off, or torch.compile's mode for the forward (reduce-overhead and
# max-autotune: CUDA graphs on a GPU; never for the rule phases, `rules_compile_kwargs`)
COMPILE_MODES = ("off", "default", "reduce-overhead", "max-autotune")


def rules_compile_kwargs(mode: str, backend: str) -> dict[str, Any]:
    """`torch.compile`'s arguments for the rule phases under `finetune.compile: mode`.

    Why never CUDA graphs there: a graph's replay writes its outputs into the same memory each
    time, and the norms phase's outputs (the kept per-example gradients) are read by the sums
    phase after it, so a later replay could overwrite tensors an earlier phase returned. Which
    modes turn CUDA graphs on is inductor's table (`torch._inductor.list_mode_options`:
    `reduce-overhead`, and `max-autotune` in current torch), not ours, so the phases get that
    mode's own options with `triton.cudagraphs` set off explicitly, rather than a list of mode
    names to avoid that the next torch could outgrow (and an explicit off also wins over a
    global `torch._inductor.config.triton.cudagraphs`). Other backends take no inductor
    options: AOTAutograd's ignore them, and the `cudagraphs` backend is refused."""
    if backend == "cudagraphs":
        raise ValueError("bk's rule phases may not run as CUDA graphs (backend 'cudagraphs')")
    if backend != "inductor":
        return {"backend": backend}
    from torch._inductor import list_mode_options

    options = dict(list_mode_options(mode)) if mode != "default" else {}
    options["triton.cudagraphs"] = False
    return {"backend": backend, "options": options}


@dataclass(frozen=True)
class _Plan:
    """What the planning forward did for one set of trained parameters and input shapes."""

    trained: dict[nn.Module, dict[str, nn.Parameter]]  # each recorded module's trained params
    switched_off: tuple[nn.Parameter, ...]
    # one zero leaf per recorded output, of its shape, dtype and device (`_call`)
    taps: dict[nn.Module, torch.Tensor]


class CompiledBookKeeping(BookKeepingModule):
    """`BookKeepingModule` whose recording forward runs `torch.compile(model)` (see above)."""

    # the compiled graphs fuse GroupNorm's kernels themselves; the eager planning forward
    # records as the compiled one does
    fuse_norms = False

    def __init__(
        self, module: nn.Module, mode: str = "default", backend: str = "inductor", **kw: Any
    ):
        if mode not in COMPILE_MODES[1:]:
            raise ValueError(f"compile mode must be one of {COMPILE_MODES[1:]}, not {mode!r}")
        super().__init__(module, **kw)
        # Not a submodule (its parameters are the model's: no second copy in state_dict).
        object.__setattr__(
            self,
            "_compiled",
            torch.compile(module, mode=mode, backend=backend, dynamic=False),
        )
        # The per-layer rules too: the norms and the clip-weighted sums from the records, one
        # graph each per trained set and shape (`_norms`, `_sums`). Their temporaries are the
        # graphs' own, so no buffer pool (the eager fallback of `_whole_step` then allocates
        # fresh tensors, the same values). Never as CUDA graphs (`rules_compile_kwargs`).
        self.workspace = None
        for phase in ("_norms", "_sums"):
            fn = getattr(super(), phase)
            compiled = torch.compile(fn, **rules_compile_kwargs(mode, backend), dynamic=False)
            object.__setattr__(self, f"_compiled{phase}", compiled)
        self._plans: dict[tuple, _Plan] = {}
        self._plan: _Plan | None = None  # the plan of the compiled forward under way
        self._planning: dict[nn.Module, torch.Tensor] | None = None  # taps made while planning
        self._taps: dict[nn.Module, torch.Tensor] = {}
        self.plans_made = 0  # planning forwards (tests, the bench)

    def _call(self, recording: bool, *args: Any, **kwargs: Any) -> Any:
        if not recording:  # evaluation, torch.func's replays: nothing to record, nothing to fuse
            return self._module(*args, **kwargs)
        shapes = tuple(
            (tuple(v.shape), v.dtype, v.device)
            for v in tree_leaves((args, kwargs))
            if torch.is_tensor(v)
        )
        key = (tuple(p.requires_grad for p in self._module.parameters()), shapes)
        plan = self._plans.get(key) or self._make_plan(key, args, kwargs)
        for p in plan.switched_off:  # restored by the base's forward, as after an eager one
            p.requires_grad_(False)
        self._switched_off = list(plan.switched_off)
        # the same tap tensors for every call of a plan (graph inputs of one identity, which
        # CUDA graphs can keep in place), their gradients cleared: a forward without its
        # backward leaves none, and the norms then refuse to run (`_complete`)
        self._taps = plan.taps
        for tap in self._taps.values():
            tap.grad = None
        self._plan = plan
        try:
            return self._compiled(*args, **kwargs)
        finally:
            self._plan = None

    def _make_plan(self, key: tuple, args: tuple, kwargs: dict) -> _Plan:
        """The eager planning forward (its output and records are dropped)."""
        self.plans_made += 1
        devices = [d for *_, d in key[1] if d.type == "cuda"][:1]
        self._planning = {}
        try:
            with torch.random.fork_rng(devices=devices):
                self._module(*args, **kwargs)
            plan = _Plan(
                {r.module: dict(r.params) for r in self.records.values()},
                tuple(self._switched_off),
                self._planning,
            )
        finally:
            self._planning = None
            self._switch_back()
            self.records = {}
        self._plans[key] = plan
        return plan

    def _trained(self, module: nn.Module) -> dict[str, nn.Parameter]:
        if self._plan is None:
            return super()._trained(module)
        return self._plan.trained.get(module, {})

    def _switch_off(self, trained: dict[str, nn.Parameter]) -> None:
        if self._plan is None:
            super()._switch_off(trained)

    def _keep_grad(self, rec, t: torch.Tensor) -> torch.Tensor | None:
        if self._planning is not None:
            self._planning[rec.module] = _zeros(t.dtype, t.device).expand(t.shape).requires_grad_()
        if self._plan is None:
            return super()._keep_grad(rec, t)
        return t + self._taps[rec.module]

    def _norms(self, taken: list, wanted: set[int], scale: float) -> torch.Tensor:
        if self._whole_step(wanted):
            return self._compiled_norms(taken, wanted, scale)
        return super()._norms(taken, wanted, scale)

    def _sums(self, wanted: set[int], factor: torch.Tensor) -> dict[int, torch.Tensor]:
        if self._whole_step(wanted):
            return self._compiled_sums(wanted, factor)
        return super()._sums(wanted, factor)

    def _whole_step(self, wanted: set[int]) -> bool:
        """Whether the rules run compiled: for a training step's whole set of trained
        parameters, all of them in closed form. Not for a subset (the self-test's module by
        module norms: a graph per subset would be compiled once and never run again) nor for
        torch.func's records, which replay their modules' forwards."""
        return all(
            isinstance(r, LayerRecord) and all(id(p) in wanted for p in r.params.values())
            for r in self.records.values()
        )

    def _complete(self, params: list[nn.Parameter]):
        for rec in self.records.values():
            tap = self._taps.get(rec.module)
            if rec.g is None and tap is not None and tap.grad is not None:
                rec.g = tap.grad
        return super()._complete(params)


_ZEROS: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _zeros(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One stored zero per dtype and device, which each tap expands (no memory per tap)."""
    key = (dtype, device)
    if key not in _ZEROS:
        _ZEROS[key] = torch.zeros((), dtype=dtype, device=device)
    return _ZEROS[key]
