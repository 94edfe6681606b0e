"""BatchNorm in a model that DP training will touch: keep it frozen, or swap it for GroupNorm.

A BatchNorm in training mode mixes the examples of a batch, so no per-example gradient exists,
and its running statistics would be computed from private data. Two ways out (`model.batchnorm`):

- `groupnorm`: Opacus' replacement at build time (`opacus.validators.ModuleValidator.fix`); the
  pre-trained statistics are lost.
- `freeze` (the default): BatchNorm stays for non-private (pre-)training; when DP training
  starts, `freeze_batchnorm` wraps each one in a `FrozenBatchNorm`, which normalises with the
  running statistics of pre-training (public) and never updates them.

Freezing must not change the model: the frozen model's outputs are the original model's
eval-mode outputs. A BatchNorm subclass may do more than normalise (timm's `BatchNormAct2d`
applies its activation and dropout inside its own forward), so `FrozenBatchNorm` keeps the
original module (`norm`) and runs *its* forward, pinned to eval mode (`models.pinned`): the
statistics are read, never updated, whatever `train()` says.

Opacus refuses any module that holds trainable parameters and buffers at once (its validator,
and functorch's `prepare_layer`): the statistics would escape the privacy accounting. So with
`finetune.bn_affine: train` the trainable scale and shift move to a child `affine` without
buffers, and the original forward's one call of `F.batch_norm` is redirected (a torch function
mode, for the duration of the call) to normalise without them and apply `affine`; everything
the forward does after it (activation, dropout) runs as written. With `bn_affine: freeze` the
scale and shift become buffers of `norm` and its forward runs untouched. Either way the state
dict keeps the original module's names (`weight`, `bias`, `running_mean`, `running_var`,
`num_batches_tracked`, `act.*`), so checkpoints written with BatchNorm load into it and back.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from dpadapter.models.pinned import pin_eval, unpinned_type

BATCHNORM_CHOICES = ("freeze", "groupnorm")
BN_AFFINE_CHOICES = ("train", "freeze")
_AFFINE_KEYS = ("weight", "bias")
_WRAPPERS = ("norm.", "affine.")


class ChannelAffine(nn.Module):
    """Per-channel scale and shift along dim 1: the trainable part of a frozen BatchNorm."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(weight.detach().clone())
        self.bias = nn.Parameter(bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = (1, -1) + (1,) * (x.dim() - 2)
        return x * self.weight.view(shape) + self.bias.view(shape)


def has_running_stats(bn: nn.Module) -> bool:
    return getattr(bn, "running_mean", None) is not None and bn.running_var is not None


class FrozenBatchNorm(nn.Module):
    """A BatchNorm (any subclass) in eval mode whatever `train()` says; not an `nn.BatchNorm`."""

    def __init__(self, bn: nn.modules.batchnorm._BatchNorm, affine: str = "train"):
        super().__init__()
        if affine not in BN_AFFINE_CHOICES:
            raise ValueError(f"bn_affine: {affine!r}; one of {BN_AFFINE_CHOICES}")
        if not has_running_stats(bn):
            raise ValueError(f"{bn} tracks no running statistics: nothing to freeze")
        n, like = bn.num_features, bn.running_mean
        w = bn.weight.detach() if bn.weight is not None else torch.ones(n, dtype=like.dtype)
        b = bn.bias.detach() if bn.bias is not None else torch.zeros(n, dtype=like.dtype)
        w, b = w.to(like.device), b.to(like.device)
        for k in _AFFINE_KEYS:  # the scale and shift leave the module's parameters
            bn._parameters.pop(k, None)
            bn.__dict__.pop(k, None)
        self.affine: ChannelAffine | None = None
        if affine == "train":
            self.affine = ChannelAffine(w, b)
            bn.weight = bn.bias = None
        else:
            bn.register_buffer("weight", w.clone())
            bn.register_buffer("bias", b.clone())
        self.norm = pin_eval(bn)
        # The original module's names in the state dict, whichever module holds the tensors.
        self._register_state_dict_hook(_flatten)
        self._register_load_state_dict_pre_hook(_nest, with_module=True)

    @property
    def num_features(self) -> int:
        return self.norm.num_features

    @property
    def eps(self) -> float:
        return self.norm.eps

    def forward(self, *args, **kwargs):
        if self.affine is None:
            return self.norm(*args, **kwargs)
        redirect = _AffineAfterNorm(self)
        with redirect:
            out = self.norm(*args, **kwargs)
        if redirect.calls != 1:
            raise RuntimeError(
                f"FrozenBatchNorm: {unpinned_type(self.norm).__name__}.forward called "
                f"F.batch_norm {redirect.calls} times, not once; its scale and shift cannot be "
                "trained apart from its statistics (finetune.bn_affine: freeze keeps them)"
            )
        return out

    def normalise(self, x: torch.Tensor) -> torch.Tensor:
        """`affine` of x normalised by the frozen statistics (the redirected `F.batch_norm`)."""
        norm = self.norm
        normed = F.batch_norm(
            x, norm.running_mean, norm.running_var, None, None, False, 0.0, norm.eps
        )
        # Per-sample hooks wrap the child's output (a view); timm's BatchNorm is followed by an
        # in-place ReLU or `+=`, which autograd forbids on such a view: hand back a copy.
        return self.affine(normed).clone()

    def extra_repr(self) -> str:
        trained = "trainable" if self.affine is not None else "frozen"
        return f"affine {trained}"


class _AffineAfterNorm(TorchFunctionMode):
    """Within `FrozenBatchNorm.norm`'s forward: `F.batch_norm` becomes `normalise`."""

    def __init__(self, frozen: FrozenBatchNorm):
        super().__init__()
        self.frozen = frozen
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.batch_norm:
            self.calls += 1
            x = args[0] if args else kwargs["input"]
            return self.frozen.normalise(x)  # the mode is off inside its own handler
        return func(*args, **kwargs)


def _flatten(module, state_dict, prefix, local_metadata):
    for k in [k for k in state_dict if k.startswith(prefix)]:
        rest = k[len(prefix) :]
        for wrapper in _WRAPPERS:
            if rest.startswith(wrapper):
                state_dict[prefix + rest[len(wrapper) :]] = state_dict.pop(k)
    return state_dict


def _nest(module, state_dict, prefix, *args):
    for k in [k for k in state_dict if k.startswith(prefix)]:
        rest = k[len(prefix) :]
        if rest.startswith(_WRAPPERS):
            continue
        inner = "affine." if module.affine is not None and rest in _AFFINE_KEYS else "norm."
        state_dict[prefix + inner + rest] = state_dict.pop(k)


def freeze_batchnorm(model: nn.Module, affine: str = "train") -> list[str]:
    """Wrap every BatchNorm of `model` (with running statistics) in a `FrozenBatchNorm`, in
    place; return their names.

    A model without BatchNorm is left untouched (so is its parameter order and every number).
    A BatchNorm without running statistics has nothing to freeze: it is left for the DP
    wrapper's independence check (`per_sample.independence`), which refuses it by name.
    """
    if affine not in BN_AFFINE_CHOICES:
        raise ValueError(f"bn_affine: {affine!r}; one of {BN_AFFINE_CHOICES}")
    swapped: list[str] = []
    _freeze_children(model, "", affine, swapped)
    return swapped


def _freeze_children(module: nn.Module, name: str, affine: str, swapped: list[str]) -> None:
    for child_name, child in list(module.named_children()):
        full = f"{name}.{child_name}" if name else child_name
        if isinstance(child, FrozenBatchNorm):
            continue
        if isinstance(child, nn.modules.batchnorm._BatchNorm) and has_running_stats(child):
            setattr(module, child_name, FrozenBatchNorm(child, affine))
            swapped.append(full)
        else:  # never into a frozen one: its forward is the original's, as it was
            _freeze_children(child, full, affine, swapped)


def batchnorm_to_groupnorm(model: nn.Module) -> nn.Module:
    """Opacus' fix: every BatchNorm becomes a GroupNorm (its statistics are dropped)."""
    from opacus.validators import ModuleValidator

    return ModuleValidator.fix(model)


def apply_batchnorm_choice(model: nn.Module, choice: str) -> nn.Module:
    """At build time: `groupnorm` converts now; `freeze` keeps BatchNorm until DP training."""
    if choice not in BATCHNORM_CHOICES:
        raise ValueError(f"model.batchnorm: {choice!r}; one of {BATCHNORM_CHOICES}")
    return batchnorm_to_groupnorm(model) if choice == "groupnorm" else model
