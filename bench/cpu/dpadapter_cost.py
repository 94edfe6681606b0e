"""What DPAdapter costs over standard training and what robustness it buys (embedded default).

Each exact DPAdapter step (refresh_every k = 1) does a forward/backward pass over B1 (m1 examples)
and another over B2 (m2), where a standard step does only the latter: about (m1 + m2) / m2 times
the work. Reusing the perturbation for k steps brings that down to (m1 / k + m2) / m2. This script
measures the ratio instead of trusting the count, in one process so every variant sees the same
machine state, and reports the public (robust) accuracy each variant reaches from the same
warm-up model, next to standard training continued for the same number of steps (the
compute-blind control: a DPAdapter gain must beat it, not just the warm-up).

Epoch times are extrapolated from the steps run (`--steps`, default 200, about half an epoch at
m2 = 64; the accuracies are therefore those after half an epoch): an epoch is ceil(n_public / m2)
steps for every variant, so the epoch-time ratio equals the per-step ratio. Timings include
nothing but the training steps (after an untimed burn-in), and the standard epoch is re-timed
next to each variant so a ratio compares the two under the same outside load. On a shared machine
they are still noisy, and with 2 threads contention hurts more than with 1 (a descheduled thread
stalls the other, so small standard steps slow down far more than DPAdapter's big B1 passes and
the ratio shrinks), hence one thread by default; compare ratios, not absolute times across runs.

    .venv/bin/python bench/cpu/dpadapter_cost.py                      # trains the warm-up itself
    .venv/bin/python bench/cpu/dpadapter_cost.py --warmup results/warmup/model.pt --steps 100
    .venv/bin/python bench/cpu/dpadapter_cost.py --warmup results/warmup/model.pt --refresh 1 \
        --ema auto --seed 1        # exact Algorithm 1 vs the dpadapter-ema option, seed 1

`--ema` adds the dpadapter-ema option (docs/speed.md): Delta from a running average of earlier
clean B2 gradients, two B2 passes per step.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import math
import time
from pathlib import Path

import torch
from torch import nn

import dpadapter.settings
from dpadapter.data import build_splits
from dpadapter.models import create_model
from dpadapter.train.checkpoint import load_model
from dpadapter.train.loops import evaluate, robust_accuracy, sgd_train
from dpadapter.upstream import UPSTREAMS, UpstreamContext
from dpadapter.upstream.dpadapter import relative_step_cost

REPO = Path(__file__).resolve().parents[2]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", default=str(REPO / "config.yaml"))
    p.add_argument("--warmup", default=None, help="warm-up checkpoint; default: train it here")
    p.add_argument(
        "--steps",
        type=int,
        default=200,
        help="update steps per variant; 0 = one epoch of B2 batches (default 200, about half "
        "an epoch at m2=64, to keep the run within minutes)",
    )
    p.add_argument("--refresh", type=int, nargs="+", default=[1, 10, 50])
    p.add_argument(
        "--ema",
        nargs="*",
        default=["auto"],
        help="ema_beta values of the dpadapter-ema option ('auto' = (m1-m2)/(m1+m2)); none: skip",
    )
    p.add_argument("--seed", type=int, default=None, help="training seed (default: the config's)")
    p.add_argument("--probe-steps", type=int, default=60, help="steps of each standard timing")
    p.add_argument("--m1", type=int, default=1024)
    p.add_argument("--m2", type=int, default=64)
    p.add_argument("--eta1", type=float, default=1.0)
    p.add_argument("--gamma", type=float, default=0.5)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--weight-decay", type=float, default=5e-4)
    p.add_argument("--chunk-size", type=int, default=1024)
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1: under outside load a 2-thread run measured the standard "
        "epoch 8x slower, which hides the ratio)",
    )
    return p.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    cfg_path = Path(args.config).resolve()
    cfg = dpadapter.settings.load(cfg_path)
    root = Path(cfg.data.root)
    if not root.is_absolute():  # the config's data root is relative to the repository
        data_cfg = dataclasses.replace(cfg.data, root=str(cfg_path.parent / root))
        cfg = dataclasses.replace(cfg, data=data_cfg)
    plan, roles = build_splits(cfg, ["public"])
    public = roles["public"]
    n = len(public.train)
    steps_per_epoch = math.ceil(n / args.m2)
    steps = args.steps if args.steps > 0 else steps_per_epoch
    r = cfg.robustness
    seed = cfg.seed if args.seed is None else args.seed

    def report(model: nn.Module) -> tuple[float, float]:
        acc = evaluate(model, public.test)
        rob = robust_accuracy(model, public.test, r.noise_std, r.draws, r.seed)
        return acc, rob

    if args.warmup:
        warm, _ = load_model(args.warmup)
        origin = args.warmup
    else:
        t0 = time.perf_counter()
        warm = create_model(cfg.model, public.num_classes, plan.in_chans, cfg.seed)
        sgd_train(warm, public.train, cfg.warmup, seed=cfg.seed, desc="warmup")
        origin = f"trained here ({cfg.warmup.epochs} epochs, {time.perf_counter() - t0:.0f} s)"
    print(
        f"config {cfg_path.name}: {n} public training examples, {len(public.test)} test; "
        f"warm-up {origin}; {args.threads} threads; training seed {seed}"
    )
    print(f"robust accuracy: weights + N(0, {r.noise_std}^2), {r.draws} draws, seed {r.seed}")
    print(
        f"m1={args.m1} m2={args.m2} eta1={args.eta1} gamma={args.gamma} lr={args.lr} "
        f"momentum={args.momentum} weight_decay={args.weight_decay}; {steps} steps per variant "
        f"= {steps / steps_per_epoch:.2f} epoch(s) of {steps_per_epoch} steps"
    )
    acc, rob = report(warm)
    warm_line = f"{'warm-up (start)':<22}{'':>44}{100 * acc:>9.1f}{100 * rob:>10.1f}"

    common = {
        "epochs": 1,
        "lr": args.lr,
        "momentum": args.momentum,
        "weight_decay": args.weight_decay,
        "milestones": [],
        "max_steps": steps,
    }
    logs: list[dict] = []
    ctx = UpstreamContext(cfg, plan, public, warm, seed, lambda e, s: logs.append(s))

    header = (
        f"{'variant':<22}{'s/epoch':>12}{'ratio':>12}{'cpu ratio':>10}{'count':>10}"
        f"{'acc %':>9}{'robust %':>10}"
    )
    print(header)
    print("-" * len(header))
    print(warm_line)

    sgd = dataclasses.replace(
        cfg.warmup,
        epochs=1,
        batch_size=args.m2,
        lr=args.lr,
        momentum=args.momentum,
        weight_decay=args.weight_decay,
        milestones=(),
        max_steps=steps,
    )
    probe = dataclasses.replace(sgd, max_steps=min(steps, args.probe_steps))

    def standard_epoch_time() -> tuple[float, float]:
        """(wall, CPU) seconds per standard epoch, from a short run on a throwaway copy.

        Re-measured next to every variant, because other load on a shared machine changes
        within minutes and a ratio against a baseline taken earlier would absorb that change.
        """
        t0, c0 = time.perf_counter(), time.process_time()
        sgd_train(copy.deepcopy(warm), public.train, probe, seed=seed, desc="probe")
        scale = steps_per_epoch / probe.max_steps
        return (time.perf_counter() - t0) * scale, (time.process_time() - c0) * scale

    standard_epoch_time()  # untimed burn-in: thread-pool and kernel set-up of a fresh process
    control = copy.deepcopy(warm)
    t0, c0 = time.perf_counter(), time.process_time()
    sgd_train(control, public.train, sgd, seed=seed, desc="standard")
    base = (time.perf_counter() - t0) / steps * steps_per_epoch
    acc, rob = report(control)
    print(
        f"{'standard (control)':<22}{base:>12.1f}{1.0:>12.2f}{1.0:>10.2f}{1.0:>10.1f}"
        f"{100 * acc:>9.1f}{100 * rob:>10.1f}",
        flush=True,
    )

    variants = [(f"dpadapter k={k}", {"refresh_every": k}) for k in args.refresh]
    variants += [
        (f"dpadapter-ema b={b}", {"ema_beta": b if b == "auto" else float(b)}) for b in args.ema
    ]
    for label, extra in variants:
        method = UPSTREAMS["dpadapter"](
            {
                **common,
                "m1": args.m1,
                "m2": args.m2,
                "eta1": args.eta1,
                "gamma": args.gamma,
                "chunk_size": args.chunk_size,
                **extra,
            }
        )
        k = int(extra.get("refresh_every", 1))
        count = 2.0 if "ema_beta" in extra else relative_step_cost(args.m1, args.m2, k)
        logs.clear()
        before = standard_epoch_time()
        t0, c0 = time.perf_counter(), time.process_time()
        model = method.build(ctx)
        per_epoch = (time.perf_counter() - t0) / steps * steps_per_epoch
        per_epoch_cpu = (time.process_time() - c0) / steps * steps_per_epoch
        after = standard_epoch_time()
        base_wall, base_cpu = (before[0] + after[0]) / 2, (before[1] + after[1]) / 2
        acc, rob = report(model)
        s = logs[-1]
        print(
            f"{label:<22}{per_epoch:>12.1f}{per_epoch / base_wall:>12.2f}"
            f"{per_epoch_cpu / base_cpu:>10.2f}{count:>10.1f}"
            f"{100 * acc:>9.1f}{100 * rob:>10.1f}"
            f"   |Delta| {s['delta_norm']:.3f} (raw {s['delta_norm_raw']:.3f}), "
            f"gamma binding {100 * s['gamma_binding']:.0f}% of {s['refreshes']} perturbations",
            flush=True,
        )
    print(
        "s/epoch: wall time extrapolated to one epoch; ratio: over a standard epoch with the same "
        "B2 size, timed just before and after each variant (mean of the two); cpu ratio: the same "
        "in process CPU time; count: (m1/k + m2)/m2, the example-pass count (ema: 2 B2 passes; "
        "one B1 pass at the start)."
    )


if __name__ == "__main__":
    main()
