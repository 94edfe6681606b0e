"""Median step time of non-private SGD vs the pipeline's DP-SGD step, in one process.

ResNet20-GroupNorm, batch 256, 1x28x28 inputs, 10 classes. The DP step is the pipeline's own
(`ALGORITHMS["dpsgd"]` on an Opacus-wrapped model), once per per-sample-gradient mode, so the
ratio printed is the one `finetune` pays. Target: <= 1.5x non-private.

    .venv/bin/python bench/dp_step.py [--steps 15] [--threads N]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from opacus.grad_sample.utils import wrap_model

import dpadapter  # noqa: F401
from dpadapter.algorithms import ALGORITHMS, DPRunSpec
from dpadapter.config import ModelConfig
from dpadapter.models import create_model
from dpadapter.privacy import PrivacyLedger

BATCH = 256


def _median_step(step, warmup: int, steps: int) -> float:
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--modes", nargs="+", default=["ew", "hooks", "functorch"])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(BATCH, 1, 28, 28, generator=g)
    y = torch.randint(0, 10, (BATCH,), generator=g)
    base = create_model(ModelConfig("resnet20-gn", 16, 16), 10, 1, seed=0)
    loss_fn = torch.nn.functional.cross_entropy

    model = copy.deepcopy(base)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def sgd_step():
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        opt.step()

    t_sgd = _median_step(sgd_step, 3, args.steps)
    print(f"threads={args.threads} batch={BATCH} model=resnet20-gn input=1x28x28")
    print(f"non-private SGD      {1000 * t_sgd:8.1f} ms/step")
    spec = DPRunSpec(1.0, 1e-5, 0.01, 100, 1, BATCH, 1.0)
    for mode in args.modes:
        m = wrap_model(
            copy.deepcopy(base), grad_sample_mode=mode, batch_first=True, loss_reduction="mean"
        )
        algo = ALGORITHMS["dpsgd"](spec, PrivacyLedger(1e-5), torch.Generator().manual_seed(1))
        algo.make_optimizer(torch.optim.SGD(m.parameters(), lr=0.01))
        t = _median_step(lambda m=m, algo=algo: algo.train_step(m, x, y, loss_fn), 3, args.steps)
        print(f"DP-SGD ({mode:9s})   {1000 * t:8.1f} ms/step   ratio {t / t_sgd:5.2f}x")


if __name__ == "__main__":
    main()
