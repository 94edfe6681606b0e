"""Conv2d kernels of book-keeping: per-example weight gradients, input patches, clipped sums.

A Conv2d's per-example weight gradient is `g_i^T P_i` (P_i example i's input patches), its
clipped sum one weight-gradient kernel on the clip-weighted output gradients. Which kernel is
faster depends on the shapes, measured on this CPU (bench/cpu/conv_per_example.py, 2 threads,
ms, grouped vs im2col + bmm, batch 256 unless said): 3->16 at 32x32 (ResNet20's stem) 17.8 vs
6.1; 4->16 at 28x28 9.5 vs 6.1; 1->64 (GNResNet-10's stem) 6.6 vs 6.7; 1->32 (DPNAS') 4.8 vs
3.5; 1->8, batch 200 (the embedded CNN's) 1.28 vs 0.62; but 8->16 at 14x14 0.68 vs 1.43 and
depthwise 32 groups at 28x28 4.4 vs 34.4. The grouped kernel runs far below its FLOP rate when
a group has few input channels; bmm does when the matrices are tiny (one output channel per
group). Hence `IM2COL_MAX_IN_CHANNELS`, on the CPU; on a GPU im2col always
(`per_example_grouped`). The rule that picks a kernel is in `rules`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dpadapter.per_sample.buffers import Workspace, buffer

# Per-example gradients of an ungrouped conv with up to this many input channels come from
# im2col + a batched matrix product, of any other conv from the grouped weight-gradient kernel
# (module docstring: the measurements).
IM2COL_MAX_IN_CHANNELS = 4
# One im2col kernel's patches hold at most this many elements (1 GiB in float32): a larger batch
# goes in chunks of examples, a few kernels each (GNResNet-10's 64-channel 28x28 convolutions
# at a physical batch of 1152: 520 million elements, two chunks).
PATCH_ELEMENTS = 1 << 28


def per_example_grouped(
    module: nn.Conv2d, a: torch.Tensor, g: torch.Tensor, w: torch.Tensor
) -> torch.Tensor:
    """(n, *w.shape): examples as groups, one grouped weight-gradient kernel for all of them.

    One call, but not one kernel on a GPU: on an H200 (2026-11-28, docs/gpu.md "the third
    loan") the modes that take per-example convolution gradients through this kernel launched
    thousands of kernels per GNResNet-10 step at batch 512 (functorch 7,983, Opacus' ew 6,592,
    bk with 6 of its convolutions here 8,518) where hooks' im2col and matrix products launched
    610, as cuDNN runs a grouped weight gradient group by group when no kernel of its own takes
    them all. So only the CPU uses it (`rules.conv_weight_norms_sq`)."""
    n, c_in = a.shape[:2]
    c_out = g.shape[1]
    grads = weight_grad(
        module,
        g.reshape(1, n * c_out, *g.shape[2:]),
        a.reshape(1, n * c_in, *a.shape[2:]),
        w.new_empty(1).expand(n * c_out, *w.shape[1:]),  # only its shape is read
        n * module.groups,
    )
    return grads.reshape(n, *w.shape)


def per_example_im2col(
    module: nn.Conv2d,
    a: torch.Tensor,
    g: torch.Tensor,
    workspace: Workspace | None = None,
    one_kernel: bool = False,
) -> torch.Tensor:
    """(n, Cout, Cin/G, kh, kw): `g_i^T P_i` per example and group, P the input patches.

    The patches are laid out (n, Cin, kh, kw, T) by one strided copy of the padded input's
    windows (rows stay contiguous), which on this CPU is 8x faster than `F.unfold` for one
    input channel and ran 1.7-2.2x faster than the kh*kw slice copies it replaced (issue 47: one
    kernel, not kh*kw; docs/speed.md). `one_kernel` (where launches dominate): `columns`, one
    kernel where the padding and the copy take two.
    """
    (kh, kw) = module.kernel_size
    n, c_in = a.shape[:2]
    c_out, ho, wo = g.shape[1:]
    groups = module.groups
    d = c_in // groups * kh * kw
    if one_kernel:
        out = _im2col_chunks(module, a, g, d)
    else:
        buf = buffer(workspace, "im2col", (n, c_in, kh, kw, ho, wo), a)
        buf.copy_(_windows(module, padded(module, a, workspace)).permute(0, 1, 4, 5, 2, 3))
        patches = buf.view(n * groups, d, ho * wo)
        out = torch.bmm(g.reshape(n * groups, c_out // groups, ho * wo), patches.transpose(1, 2))
    return out.reshape(n, c_out, c_in // groups, kh, kw)


def _im2col_chunks(module: nn.Conv2d, a: torch.Tensor, g: torch.Tensor, d: int) -> torch.Tensor:
    """(n G, Cout/G, d): `per_example_im2col` with patches from one kernel (`columns`), in chunks
    of examples whose patches fit `PATCH_ELEMENTS`: two kernels a chunk, memory bounded whatever
    the batch."""
    n, groups = a.shape[0], module.groups
    c_out, ho, wo = g.shape[1:]
    t = ho * wo
    step = max(1, PATCH_ELEMENTS // (groups * d * t))
    parts = []
    for i in range(0, n, step):  # a plain loop and cat (no `out=` views): compiles as it runs
        j = min(n, i + step)
        patches = columns(module, a[i:j]).view((j - i) * groups, d, t)
        grads = g[i:j].reshape((j - i) * groups, c_out // groups, t)
        parts.append(torch.bmm(grads, patches.transpose(1, 2)))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def weight_grad(
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


def padded(
    module: nn.Conv2d,
    a: torch.Tensor,
    workspace: Workspace | None,
    memory_format: torch.memory_format = torch.contiguous_format,
) -> torch.Tensor:
    """`a` zero-padded as the conv pads it, in `memory_format`: one copy into the interior of a
    kept buffer whose border stays zero (padding and the change of layout in one kernel, where
    `F.pad` and `.contiguous` took two). Without padding, `a` itself in that layout."""
    ph, pw = module.padding  # type: ignore[misc]
    if ph == pw == 0:
        return a.contiguous(memory_format=memory_format)
    n, c, h, w = a.shape
    shape = (n, c, h + 2 * ph, w + 2 * pw)
    buf = buffer(workspace, f"padded{ph}x{pw}", shape, a, memory_format, zeroed=True)
    buf[:, :, ph : ph + h, pw : pw + w] = a
    return buf


def _windows(module: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """(n, C, Ho, Wo, kh, kw): every output position's input window of the padded `x` (a view)."""
    (kh, kw), (sh, sw), (dh, dw) = module.kernel_size, module.stride, module.dilation
    v = x.unfold(2, dh * (kh - 1) + 1, sh).unfold(3, dw * (kw - 1) + 1, sw)
    return v[..., ::dh, ::dw]


def columns(module: nn.Conv2d, a: torch.Tensor) -> torch.Tensor:
    """Input patches (n, Cin*kh*kw, T) from one im2col kernel (`F.unfold`), padding included.

    Where kernel launches dominate (a GPU at our users' sizes, issue 47) one kernel instead of
    the padded copy and the strided copy of `patches`; on this CPU `F.unfold` ran 2-8x slower
    than those two (ResNet20's and GNResNet-10's convolutions at batch 64, docs/speed.md), so
    the CPU keeps them. The same values in another order of the columns (channel-major), which
    a Gram product over the positions does not see."""
    return F.unfold(a, module.kernel_size, module.dilation, module.padding, module.stride)


def patches(module: nn.Conv2d, a: torch.Tensor, workspace: Workspace | None = None) -> torch.Tensor:
    """Input patches (n, T, kh*kw*Cin) copied from a channels-last view (contiguous rows).

    With a `workspace` the copy goes into a buffer kept there for the layout; the result is only
    valid until the next call with the same layout (ghost norms consume it at once).
    """
    # unpadded (a 1x1 downsampling conv): the windows copied from `a` as it is laid out, one
    # copy where a channels-last copy of all of `a` and then of its windows took two (issue 47)
    x = a if module.padding == (0, 0) else padded(module, a, workspace, torch.channels_last)
    v = _windows(module, x)
    n, c, ho, wo, kh, kw = v.shape
    v = v.permute(0, 2, 3, 4, 5, 1)
    if workspace is None:
        return v.reshape(n, ho * wo, kh * kw * c)
    buf = buffer(workspace, "patches", tuple(v.shape), a)
    return buf.copy_(v).view(n, ho * wo, kh * kw * c)
