"""Per-example conv weight gradients: the grouped kernel against im2col + bmm, per layer shape.

The evidence behind `IM2COL_MAX_IN_CHANNELS` in dpadapter.per_sample.conv: both
kernels on the convolutions of the benchmarked models, in one process, median of `--repeats` calls.

    .venv/bin/python bench/cpu/conv_per_example.py [--threads 2] [--repeats 30]
"""

from __future__ import annotations

import argparse
from functools import partial

import torch
from dp_step import _median_step  # bench/ is on sys.path when run as a script
from torch import nn

from dpadapter.per_sample.conv import per_example_grouped, per_example_im2col

# (in, out, input side, batch, groups, where it occurs)
SHAPES = [
    (3, 16, 32, 256, 1, "ResNet20's stem"),
    (4, 16, 28, 256, 1, ""),
    (1, 64, 28, 256, 1, "GNResNet-10's stem"),
    (1, 32, 28, 256, 1, "DPNAS-MNIST's stem"),
    (1, 8, 28, 200, 1, "the embedded CNN's stem"),
    (8, 16, 14, 200, 1, "the embedded CNN's second conv"),
    (32, 32, 28, 256, 32, "DPNAS' depthwise"),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}")
    print("| conv (in -> out, side, batch, groups) | grouped kernel | im2col + bmm | max diff |")
    print("|---|---|---|---|")
    for c_in, c_out, side, n, groups, where in SHAPES:
        m = nn.Conv2d(c_in, c_out, 3, 1, 1, groups=groups)
        a, g = torch.randn(n, c_in, side, side), torch.randn(n, c_out, side, side)
        workspace: dict = {}
        kernels = {
            "grouped": partial(per_example_grouped, m, a, g, m.weight),
            "im2col": partial(per_example_im2col, m, a, g, workspace),
        }
        diff = float((kernels["grouped"]() - kernels["im2col"]()).abs().max())
        ms = {k: 1000 * _median_step(f, 3, args.repeats) for k, f in kernels.items()}
        label = f"{c_in} -> {c_out}, {side}x{side}, {n}, {groups}"
        label += f" ({where})" if where else ""
        print(f"| {label} | {ms['grouped']:.2f} ms | {ms['im2col']:.2f} ms | {diff:.1e} |")


if __name__ == "__main__":
    main()
