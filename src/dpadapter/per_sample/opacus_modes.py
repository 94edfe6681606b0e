"""Opacus' per-sample modes (hooks, functorch, ew), wrapped for DP training.

Their DP optimizer clips in full FP32 (`optimizers.FP32Clip`): Opacus' clip takes the norms
and the clipped sum (an einsum) with different kernels, and under TF32 a clipped example could
add ~1e-3 more than C to the sum.

`hooks` mode refuses a Conv2d input whose memory layout is a permutation (channels-last, or
H and W transposed) rather than row-major: Opacus 1.6's hooks-mode Conv2d unfolds its input
with `as_strided` on the assumption that W has stride 1 and H stride W, and for a dense permuted
input (whose layout `F.pad` keeps: channels-last always, an H/W transpose when unpadded) it
returns wrong per-example gradients without any error (relative error 1.4 on a one-conv model;
`ew` and `functorch` are exact); every dense permuted layout is refused. Such inputs
arise from timm's LayerNorm2d (it permutes) or `memory_format=torch.channels_last`. Refusing
is preferred over copying the input to row-major: a copy per conv per step would be paid
silently, and the refusal names the conv, so the user picks `ew`/`functorch` or a row-major
model. Sliced (non-dense) inputs are copied by `F.pad` and come out right, so they pass.
tests/per_sample/test_hooks_channels_last.py reproduces the error on raw Opacus.

`hooks` and `functorch` put their hooks on every module with parameters, whatever is trainable
when the model is wrapped, and a module frozen at the moment records nothing. Opacus hooks only
the modules trainable at wrap time, so a strategy that unfreezes layers later (UT's switch from
the head to every parameter) had no per-example gradients for them, and its backward hook fires
on a frozen module the gradient passes through (BiTFiT: a bias-free conv between trained
biases) and fails for lack of activations.
"""

from __future__ import annotations

import torch
from opacus.grad_sample import GradSampleModule
from opacus.grad_sample.utils import wrap_model
from opacus.utils.module_utils import requires_grad
from torch import nn

OPACUS_MODES = ("hooks", "functorch", "ew")


class _PhasedGradSampleModule(GradSampleModule):
    """Opacus' hooks/functorch module whose frozen modules (for now) record nothing."""

    def capture_backprops_hook(self, module: nn.Module, *args, **kwargs) -> None:
        if not requires_grad(module):
            return None
        return super().capture_backprops_hook(module, *args, **kwargs)


def wrap_opacus(model: nn.Module, mode: str) -> nn.Module:
    if mode in ("hooks", "functorch"):
        frozen = [p for p in model.parameters() if not p.requires_grad]
        for p in frozen:  # hooked too: a phase may train them later
            p.requires_grad_(True)
        try:
            wrapped = _PhasedGradSampleModule(
                model, batch_first=True, loss_reduction="mean", force_functorch=mode == "functorch"
            )
        finally:
            for p in frozen:
                p.requires_grad_(False)
    else:
        wrapped = wrap_model(model, grad_sample_mode=mode, batch_first=True, loss_reduction="mean")
    if mode == "hooks":
        _guard_conv_layouts(wrapped, model)
    _record_rows(wrapped)
    return wrapped


def _record_rows(wrapped: nn.Module) -> None:
    """The batch size of each forward, for the clip's check that every per-example gradient
    has one row per example (`optimizers.FP32Clip`): Opacus takes a layer's first dimension as
    the examples, and a layer fed the batch folded into its rows would be clipped per row."""
    wrapped.dp_rows = None

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        x = next((v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)), None)
        module.dp_rows = None if x is None or x.dim() == 0 else x.shape[0]

    wrapped.register_forward_pre_hook(hook, with_kwargs=True)


def permuted_layout(x: torch.Tensor) -> bool:
    """A dense tensor whose strides are not row-major (channels-last is one)."""
    return (
        not x.is_contiguous()
        and x.numel() > 0
        and torch.empty_like(x, memory_format=torch.preserve_format).stride() == x.stride()
    )


def _guard_conv_layouts(wrapped: nn.Module, model: nn.Module) -> None:
    """Refuse permuted inputs of trained Conv2d layers (module docstring); removed on `_close`."""
    handles = []
    for name, m in model.named_modules():
        if isinstance(m, nn.Conv2d):
            handles.append(m.register_forward_pre_hook(_refuse_permuted(name)))
    close = wrapped._close

    def _close() -> None:
        for h in handles:
            h.remove()
        close()

    wrapped._close = _close


def _refuse_permuted(name: str):
    def hook(module: nn.Module, args: tuple) -> None:
        x = args[0] if args else None
        if not torch.is_grad_enabled() or not isinstance(x, torch.Tensor):
            return
        trained = any(p.requires_grad for p in module.parameters(recurse=False))
        if trained and permuted_layout(x):  # a frozen conv gets no per-example gradient
            raise RuntimeError(
                f"grad_sample_mode 'hooks': the input of Conv2d {name!r} has strides "
                f"{tuple(x.stride())} (channels-last or another permuted layout), for which "
                "Opacus' hooks mode computes wrong per-example gradients; use grad_sample_mode "
                "ew or functorch, or feed the model row-major (contiguous) tensors"
            )

    return hook
