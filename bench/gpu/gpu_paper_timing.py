"""Time one job of each kind of configs/paper.yaml on CIFAR-shaped data; project the grid.

Measured on synthetic 3x32x32 data with the paper's shapes (ResNet20-GN, CIFAR-100 public set of
50,000 images, private tasks of CIFAR-10 / SVHN / STL-10 size), each in this process:
  - a warm-up step (batch 128) -> a warm-up epoch;
  - one DPAdapter iteration (m1 = 5000 in chunks of 1000, m2 = 50), one SAM iteration (m = 100),
    one control step (batch 50);
  - one DP fine-tuning step per algorithm at the paper config's batch (expected 1000, physical
    250, padded on CUDA) -> a fine-tuning epoch of 45,000 examples.
Then the projected device-hours of the whole grid (5 upstreams x 3 tasks x 6 algorithms x 2
epsilons x 3 seeds, 100 epochs; warm-up 200 epochs) for both readings of DPAdapter's K
(1000 iterations: configs/paper.yaml; 1000 epochs: configs/paper-epochs.yaml).

    python bench/gpu/gpu_paper_timing.py --out $OUT/paper_timing.json        # on the GPU
    python bench/gpu/gpu_paper_timing.py --quick                             # check it runs (CPU)
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import statistics
import time
from pathlib import Path

import torch
from torch.utils.data import TensorDataset

import dpadapter  # noqa: F401
from dpadapter.algorithms import ALGORITHMS
from dpadapter.ground import device as devices
from dpadapter.models import create_model
from dpadapter.per_sample import effective_mode, wrap_for_dp
from dpadapter.per_sample.precision import make_precision
from dpadapter.privacy import PrivacyLedger
from dpadapter.settings import load
from dpadapter.train.batching import masked_cross_entropy, padded_size
from dpadapter.train.dp_spec import run_spec
from dpadapter.train.loops import make_sgd, standard_step
from dpadapter.upstream import UPSTREAMS

REPO = Path(__file__).resolve().parents[2]
TASK_SIZES = {"cifar10": 45000, "svhn": 68257, "stl10": 4500}  # configs/paper.yaml n_train


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _median(fn, dev, warmup: int, reps: int) -> float:
    for _ in range(warmup):
        fn()
    _sync(dev)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        _sync(dev)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _data(n: int, classes: int, dev) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 3, 32, 32, generator=g)
    y = torch.randint(0, classes, (n,), generator=g)
    return TensorDataset(x.to(dev), y.to(dev))


def _project(out: dict, cfg, s: dict) -> None:
    ft = cfg.finetune
    n_up, n_eps, n_seeds = len(cfg.upstreams), len(ft.epsilons), len(ft.seeds)
    ft_h = (
        sum(
            s[f"finetune_epoch_{a}"] * (n / 45000) * ft.epochs * n_up * n_eps * n_seeds
            for a in ft.algorithms
            for n in TASK_SIZES.values()
        )
        / 3600
    )
    k = 1000
    iters_per_epoch = 50000 // 50
    proj = {
        "warmup_h": s["warmup_epoch"] * cfg.warmup.epochs / 3600,
        "finetune_grid_h": ft_h,
        "upstream_iterations_reading_h": (
            k * (s["dpadapter_iteration"] + s["sam_iteration"] + s["control_step"]) / 3600
        ),
        "upstream_epochs_reading_h": (
            k * iters_per_epoch * (s["dpadapter_iteration"] + s["control_step"])
            + k * (50000 // 100) * s["sam_iteration"]
        )
        / 3600,
    }
    proj["total_iterations_reading_h"] = (
        proj["warmup_h"] + proj["finetune_grid_h"] + proj["upstream_iterations_reading_h"]
    )
    proj["total_epochs_reading_h"] = (
        proj["warmup_h"] + proj["finetune_grid_h"] + proj["upstream_epochs_reading_h"]
    )
    out["projection_device_hours"] = proj


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--quick", action="store_true", help="tiny sizes: check that it runs")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--scale", type=int, default=20, help="--quick divides every batch by this")
    ap.add_argument("--algorithms", nargs="+", help="time only these (default: the config's)")
    args = ap.parse_args(argv)
    cfg = load(REPO / "configs/paper.yaml")
    dev = devices.resolve("auto")
    devices.configure(dev, cfg.tf32)
    scale = args.scale if args.quick else 1
    reps, warm = (2, 1) if args.quick else (args.reps, 3)
    n_pub = 50000 // scale
    public = _data(n_pub, 100, dev)
    x_all, y_all = public.tensors
    out: dict = {"device": devices.describe(dev), "quick": args.quick, "seconds": {}}
    s = out["seconds"]

    def save() -> None:  # after every timing: a run cut at a deadline keeps what it measured
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(out, indent=2, default=float) + "\n")

    model = create_model(cfg.model, 100, 3, 0).to(dev)
    opt, _ = make_sgd(model, cfg.warmup)
    b = cfg.warmup.batch_size // scale
    s["warmup_step"] = _median(
        lambda: standard_step(model, opt, x_all[:b], y_all[:b]), dev, warm, reps
    )
    s["warmup_epoch"] = s["warmup_step"] * (50000 // cfg.warmup.batch_size)
    save()

    for name in ("dpadapter", "sam"):
        params = dict(cfg.upstream_params[name])
        for k in ("m1", "m2", "m", "chunk_size"):
            if k in params:
                params[k] = max(1, params[k] // scale)
        method = UPSTREAMS[name](params)
        step = method.make_step(public, 0)
        m = copy.deepcopy(model)
        o, _ = make_sgd(m, method.sgd_config())
        bs = method.update_batch_size()
        s[f"{name}_iteration"] = _median(
            lambda step=step, m=m, o=o, bs=bs: step(m, o, x_all[:bs], y_all[:bs]),
            dev,
            warm,
            reps,
        )
    m = copy.deepcopy(model)
    o, _ = make_sgd(m, UPSTREAMS["dpadapter"](cfg.upstream_params["dpadapter"]).sgd_config())
    bs = 50 // min(scale, 50) or 1
    s["control_step"] = _median(
        lambda: standard_step(m, o, x_all[:bs], y_all[:bs]), dev, warm, reps
    )

    task = _data(45000 // scale, 10, dev)
    ft = cfg.finetune
    for algo in args.algorithms or ft.algorithms:
        spec = run_spec(cfg, algo, 1.0, 45000)  # the paper's q and steps, whatever --quick
        spec = dataclasses.replace(spec, calibration_cache=None)
        net = create_model(cfg.model, 10, 3, 0).to(dev)
        run = ALGORITHMS[algo](
            spec, PrivacyLedger(spec.delta, spec.accountant), devices.generator(dev, 0)
        )
        # the pipeline's own wrapper: every mode (bk included), as dp_fit wraps the model
        gsm = wrap_for_dp(net, ft.grad_sample_mode, run.needs_per_sample_gradients)
        run.grad_sample_mode = effective_mode(ft.grad_sample_mode, run.needs_per_sample_gradients)
        if run.needs_public_data:
            run.set_public_data(public)
        run.precision = make_precision(ft.precision, dev)
        base = torch.optim.SGD(gsm.parameters(), lr=ft.lr, momentum=ft.momentum)
        run.optimizer = run.make_optimizer(base, gsm)
        phys = (ft.physical_batch_size or spec.expected_batch_size) // scale or 1
        pad = dev.type == "cuda"
        size = phys if pad else phys
        xb, yb = task.tensors[0][:size], task.tensors[1][:size]
        loss = masked_cross_entropy if pad else torch.nn.functional.cross_entropy
        expected = max(1, spec.expected_batch_size // scale)
        logical = padded_size(expected, spec.sample_rate) if pad else expected
        per_logical = max(1, -(-logical // phys))  # physical batches per release

        def logical_step(run=run, gsm=gsm, xb=xb, yb=yb, loss=loss, k=per_logical):
            for i in range(k):
                run.optimizer.signal_skip_step(do_skip=i < k - 1)
                run.train_step(gsm, xb, yb, loss)

        t = _median(logical_step, dev, 1, max(2, reps // 2))
        s[f"finetune_step_{algo}"] = t
        s[f"finetune_epoch_{algo}"] = t * spec.steps_per_epoch
        save()
    if dev.type == "cuda":
        out["peak_gpu_memory_gb"] = torch.cuda.max_memory_allocated() / 2**30

    # Projection of the whole grid, device-hours (one device per job, jobs in sequence);
    # only when every algorithm of the grid was timed.
    missing = [a for a in ft.algorithms if f"finetune_epoch_{a}" not in s]
    if missing:
        out["projection_device_hours"] = f"not projected: {missing} not timed"
    else:
        _project(out, cfg, s)
    out["done"] = True
    save()
    print(json.dumps(out, indent=2, default=float))
    if args.quick:
        print("(--quick: sizes divided by 20; the projection is not meaningful)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
