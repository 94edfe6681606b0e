"""Step time of each DP algorithm relative to DP-SGD, in one process.

ResNet20-GroupNorm, 10 classes, 1x28x28 inputs, logical batch 256 (one physical batch), SGD
with momentum. Algorithms are timed round-robin (one step each per round) so that load from
other processes on a shared machine hits them alike; each ratio is reported both as the ratio
of median step times and as the median of the per-round ratios, for wall-clock time and for
the process's CPU time (steadier on a loaded machine, most of all with --threads 1).
Calibration is not timed (a fixed sigma is used). GEP gets random public data (its cost does not
depend on the values).

    .venv/bin/python bench/cpu/dp_algorithms.py [--rounds 7] [--mode ew] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from opacus.grad_sample.utils import wrap_model
from torch import nn
from torch.utils.data import TensorDataset

from dpadapter.algorithms import ALGORITHMS, DPRunSpec
from dpadapter.models import create_model
from dpadapter.privacy import PrivacyLedger
from dpadapter.settings import ModelConfig

BATCH = 256
BASELINE = "dpsgd"
COMPARED = ["dpsat", "dpsam", "gep", "adpclip", "dpsat-momentum"]


def build(name: str, mode: str, public: TensorDataset):
    cls = ALGORITHMS[name]
    fixed = type(cls.__name__, (cls,), {"calibrate": lambda self: 1.0})
    spec = DPRunSpec(
        target_epsilon=4.0,
        delta=1e-5,
        sample_rate=BATCH / 50_000,
        steps_per_epoch=50_000 // BATCH,
        epochs=1,
        expected_batch_size=BATCH,
        max_grad_norm=1.0,
    )
    algo = fixed(spec, PrivacyLedger(1e-5), torch.Generator().manual_seed(0))
    if algo.needs_public_data:
        algo.set_public_data(public)
    model = create_model(ModelConfig("resnet20-gn", 16, 16), 10, 1, seed=0)
    gsm = wrap_model(model, grad_sample_mode=mode, batch_first=True, loss_reduction="mean")
    algo.make_optimizer(torch.optim.SGD(gsm.parameters(), lr=0.01, momentum=0.9), gsm)
    algo.start_epoch(0)
    return algo, gsm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--mode", default="ew", choices=["ew", "hooks", "functorch"])
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(BATCH, 1, 28, 28, generator=g)
    y = torch.randint(0, 10, (BATCH,), generator=g)
    public = TensorDataset(torch.randn(500, 1, 28, 28, generator=g), torch.zeros(500).long())
    names = [BASELINE, *COMPARED]
    runs = {n: build(n, args.mode, public) for n in names}
    loss_fn = nn.functional.cross_entropy
    times: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.warmup + args.rounds):
        for n in names:
            algo, gsm = runs[n]
            t0, c0 = time.perf_counter(), time.process_time()
            algo.train_step(gsm, x, y, loss_fn)
            dt, dc = time.perf_counter() - t0, time.process_time() - c0
            if r >= args.warmup:
                times[n].append(dt)
                cpu[n].append(dc)
        label = "warm-up" if r < args.warmup else "round"
        done = "  ".join(f"{n} {times[n][-1]:.2f}s" for n in names if r >= args.warmup)
        print(f"{label} {r + 1}/{args.warmup + args.rounds} {done}", file=sys.stderr, flush=True)
    print(
        f"ResNet20-GN, batch {BATCH}, 1x28x28, grad_sample_mode={args.mode}, "
        f"threads={torch.get_num_threads()}, rounds={args.rounds} (+{args.warmup} warm-up)"
    )
    for label, t in (("wall", times), ("cpu", cpu)):
        base = statistics.median(t[BASELINE])
        print(f"[{label} time] {BASELINE:>15}: median step {base:.3f} s")
        for n in COMPARED:
            med = statistics.median(t[n])
            paired = statistics.median(a / b for a, b in zip(t[n], t[BASELINE], strict=True))
            print(
                f"[{label} time] {n:>15}: median step {med:.3f} s  ratio to DP-SGD "
                f"{med / base:.3f} (median of paired ratios {paired:.3f})"
            )


if __name__ == "__main__":
    main()
