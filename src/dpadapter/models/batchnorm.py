"""BatchNorm in a model that DP training will touch: keep it frozen, or swap it for GroupNorm.

A BatchNorm in training mode mixes the examples of a batch, so no per-example gradient exists,
and its running statistics would be computed from private data. Two ways out (`model.batchnorm`):

- `groupnorm`: Opacus' replacement at build time (`opacus.validators.ModuleValidator.fix`); the
  pre-trained statistics are lost.
- `freeze` (the default): BatchNorm stays for non-private (pre-)training; when DP training
  starts, `freeze_batchnorm` turns each one into a `FrozenBatchNorm`, which normalises with the
  running statistics of pre-training (public) and never updates them.

Opacus refuses any module that holds trainable parameters and buffers at once (its validator,
and functorch's `prepare_layer`): the statistics would escape the privacy accounting. So a
`FrozenBatchNorm` holds the statistics itself and puts its trainable scale and shift in a child
`FrozenBatchNorm.affine` that has no buffers; with `finetune.bn_affine: freeze` the scale and
shift are buffers too and no child exists. Either way the state dict keeps BatchNorm's own
names (`weight`, `bias`, `running_mean`, `running_var`, `num_batches_tracked`), so checkpoints
written with BatchNorm load into it and back.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

BATCHNORM_CHOICES = ("freeze", "groupnorm")
BN_AFFINE_CHOICES = ("train", "freeze")
_AFFINE_KEYS = ("weight", "bias")


class ChannelAffine(nn.Module):
    """Per-channel scale and shift along dim 1: the trainable part of a frozen BatchNorm."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(weight.detach().clone())
        self.bias = nn.Parameter(bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = (1, -1) + (1,) * (x.dim() - 2)
        return x * self.weight.view(shape) + self.bias.view(shape)


class FrozenBatchNorm(nn.Module):
    """Eval-mode BatchNorm whatever `train()` says; not an `nn.BatchNorm` (Opacus accepts it)."""

    def __init__(self, bn: nn.modules.batchnorm._BatchNorm, affine: str = "train"):
        super().__init__()
        if affine not in BN_AFFINE_CHOICES:
            raise ValueError(f"bn_affine: {affine!r}; one of {BN_AFFINE_CHOICES}")
        if bn.running_mean is None or bn.running_var is None:
            raise ValueError(f"{bn} tracks no running statistics: nothing to freeze")
        self.eps = bn.eps
        self.num_features = bn.num_features
        self.register_buffer("running_mean", bn.running_mean.detach().clone())
        self.register_buffer("running_var", bn.running_var.detach().clone())
        nbt = bn.num_batches_tracked
        self.register_buffer(
            "num_batches_tracked",
            nbt.detach().clone() if nbt is not None else torch.tensor(0, dtype=torch.long),
        )
        n = bn.num_features
        like = bn.running_mean
        w = bn.weight.detach() if bn.weight is not None else torch.ones(n, dtype=like.dtype)
        b = bn.bias.detach() if bn.bias is not None else torch.zeros(n, dtype=like.dtype)
        self.affine: ChannelAffine | None = None
        if affine == "train":
            self.affine = ChannelAffine(w, b)
        else:
            self.register_buffer("weight", w.clone())
            self.register_buffer("bias", b.clone())
        # BatchNorm's names in the state dict, whichever module holds the tensors.
        self._register_state_dict_hook(_flatten_affine)
        self._register_load_state_dict_pre_hook(_nest_affine, with_module=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.affine is None:
            return F.batch_norm(
                x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps
            )
        normed = F.batch_norm(
            x, self.running_mean, self.running_var, None, None, False, 0.0, self.eps
        )
        # Per-sample hooks wrap the child's output (a view); timm's BatchNorm is followed by an
        # in-place ReLU or `+=`, which autograd forbids on such a view: hand back a copy.
        return self.affine(normed).clone()

    def extra_repr(self) -> str:
        trained = "trainable" if self.affine is not None else "frozen"
        return f"{self.num_features}, eps={self.eps}, affine {trained}"


def _flatten_affine(module, state_dict, prefix, local_metadata):
    if module.affine is not None:
        for k in _AFFINE_KEYS:
            state_dict[prefix + k] = state_dict.pop(prefix + "affine." + k)
    return state_dict


def _nest_affine(module, state_dict, prefix, *args):
    if module.affine is not None:
        for k in _AFFINE_KEYS:
            if prefix + k in state_dict:
                state_dict[prefix + "affine." + k] = state_dict.pop(prefix + k)


def freeze_batchnorm(model: nn.Module, affine: str = "train") -> list[str]:
    """Replace every BatchNorm of `model` in place by a `FrozenBatchNorm`; return their names.

    A model without BatchNorm is left untouched (so is its parameter order and every number).
    """
    if affine not in BN_AFFINE_CHOICES:
        raise ValueError(f"bn_affine: {affine!r}; one of {BN_AFFINE_CHOICES}")
    swapped = []
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.modules.batchnorm._BatchNorm):
                frozen = FrozenBatchNorm(child, affine)
                frozen.to(device=child.running_mean.device)
                setattr(module, child_name, frozen)
                swapped.append(f"{name}.{child_name}" if name else child_name)
    return swapped


def batchnorm_to_groupnorm(model: nn.Module) -> nn.Module:
    """Opacus' fix: every BatchNorm becomes a GroupNorm (its statistics are dropped)."""
    from opacus.validators import ModuleValidator

    return ModuleValidator.fix(model)


def apply_batchnorm_choice(model: nn.Module, choice: str) -> nn.Module:
    """At build time: `groupnorm` converts now; `freeze` keeps BatchNorm until DP training."""
    if choice not in BATCHNORM_CHOICES:
        raise ValueError(f"model.batchnorm: {choice!r}; one of {BATCHNORM_CHOICES}")
    return batchnorm_to_groupnorm(model) if choice == "groupnorm" else model
