"""Modules pinned to eval mode: their own `training` flag reads False whatever sets it.

A normalisation layer with running statistics (BatchNorm, `InstanceNorm(track_running_stats)`,
timm's EvoNorm B*) computes batch statistics in training mode: each example's output then
depends on the other examples of its batch, and the running buffers learn from private data.
In eval mode the same module uses the statistics it already has (from public pre-training) and
updates nothing. DP training switches the whole model to training mode (`model.train()`, and
strategies or Opacus may set flags module by module), so freezing such a module means making
its own flag immune to all of that, not calling `eval()` once.

The pin is a class swap to a subclass whose `training` is a read-only property: every forward
of the class (and of any subclass, timm's `BatchNormAct2d` with its activation included) runs
unchanged, in its eval branch. Only the module's own flag is pinned; its children still follow
`train()`/`eval()` (a dropout inside keeps training mode). Parameters, buffers, hooks and the
state dict are untouched, so wrapped per-sample hooks keep working.
"""

from __future__ import annotations

from torch import nn

_PINNED: dict[type, type] = {}


class _Pinned:
    """Mixed in first: `training` reads False and ignores writes."""

    @property
    def training(self) -> bool:
        return False

    @training.setter
    def training(self, value: bool) -> None:
        pass


def pin_eval(module: nn.Module) -> nn.Module:
    """Pin `module`'s own flag to eval, in place (idempotent); returns it."""
    cls = type(module)
    if issubclass(cls, _Pinned):
        return module
    if cls not in _PINNED:
        _PINNED[cls] = type(f"EvalPinned{cls.__name__}", (_Pinned, cls), {"__module__": __name__})
    module.__class__ = _PINNED[cls]
    return module


def unpin(module: nn.Module) -> nn.Module:
    """Undo `pin_eval`: the module's own flag is again what it was before (kept meanwhile)."""
    module.__class__ = unpinned_type(module)
    return module


def is_pinned(module: nn.Module) -> bool:
    return isinstance(module, _Pinned)


def unpinned_type(module: nn.Module) -> type:
    """The module's class before pinning (what a report names)."""
    cls = type(module)
    return cls.__mro__[2] if issubclass(cls, _Pinned) else cls
