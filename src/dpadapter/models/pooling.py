"""Max pooling that is fast on the CPU and gives torch's numbers bit for bit.

torch's CPU max-pool kernel for contiguous (NCHW) tensors is several times slower than its
channels-last kernel at the few channels of our small CNNs, and was the costliest single op of
the embedded default's fine-tuning job (1.2 s of a 5 s job, cProfile, 2026-11-27, 2-core CPU).
Both kernels keep the first maximum of each window in the same scan order (NaN wins), so this
pools in channels-last, hands back a contiguous output and routes the gradient with torch's own
contiguous backward kernel from those indices: values, indices and gradients are torch's, tie for
tie (tests/models/test_pooling.py). The gradient it returns is contiguous, so the layers below
see the layout they would have seen; a plain `.contiguous(channels_last)` round trip would hand
them a channels-last gradient and change which kernels they run.

Where the fast path cannot or need not run it is torch's `nn.MaxPool2d` unchanged: on CUDA,
under torch.func transforms (vmap cannot query a channels-last layout; the per-sample
references run there), for unbatched input, and when indices are asked for. Written by hand: no
library offers it; torch's own module is the oracle in the tests.
"""

from __future__ import annotations

import torch
from torch import nn

_aten = torch.ops.aten


class _ChannelsLastMaxPool(torch.autograd.Function):
    @staticmethod
    def forward(x, kernel, stride, padding, dilation, ceil_mode):
        out, idx = _aten.max_pool2d_with_indices(
            x.contiguous(memory_format=torch.channels_last),
            kernel, stride, padding, dilation, ceil_mode,
        )  # fmt: skip
        return out.contiguous(), idx.contiguous()

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, kernel, stride, padding, dilation, ceil_mode = inputs
        ctx.mark_non_differentiable(output[1])
        ctx.save_for_backward(x, output[1])
        ctx.args = (kernel, stride, padding, dilation, ceil_mode)

    @staticmethod
    def backward(ctx, grad, _grad_idx):
        x, idx = ctx.saved_tensors
        g = _aten.max_pool2d_with_indices_backward(grad.contiguous(), x, *ctx.args, idx)
        return g, None, None, None, None, None


def _pair(v) -> list[int]:
    return [v, v] if isinstance(v, int) else list(v)


class MaxPool2d(nn.MaxPool2d):
    """`nn.MaxPool2d` (same arguments, same state, an instance of it) with the CPU fast path."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (
            x.device.type != "cpu"
            or x.dim() != 4
            or self.return_indices
            or not x.is_contiguous()
            or torch._C._are_functorch_transforms_active()
        ):
            return super().forward(x)
        stride = self.stride if self.stride is not None else self.kernel_size
        out, _ = _ChannelsLastMaxPool.apply(
            x,
            _pair(self.kernel_size), _pair(stride), _pair(self.padding),
            _pair(self.dilation), self.ceil_mode,
        )  # fmt: skip
        return out
