"""GPU smoke test: every DP algorithm in every per-sample mode, warm-up and DPAdapter on CUDA.

Each run is checked by functions that can each fail (tests/bench/test_gpu_smoke.py shows every
one failing on CPU with its bug planted):

- `check_device`: every parameter and every physical batch on the GPU;
- `check_shapes`: one padded physical shape on CUDA (cuDNN re-tunes per shape);
- `check_finite` / `check_accuracy`: finite weights and a held-out accuracy well above chance on
  a learnable synthetic task (a run that trains nothing fails);
- `check_noise`: the noise actually added, p.grad * B - clipped sum (the algorithm's audit
  trail), pooled over every release and divided by its declared std, has std 1; the declared
  stds give the joint multiplier the ledger records, which is the calibrated sigma;
- `check_epsilon`: the ledger holds one record per planned release and epsilon recomputed from
  that history is within the target;
- `check_repeat`: a second run with the same seeds gives bit-identical weights, in cuDNN's
  deterministic mode with TF32 off (`deterministic()`), so that a difference means a seed or an
  RNG state is not honoured rather than atomics reordering sums.

Writes a JSON report and prints it; exit 1 when any check failed (every failure is listed),
2 without CUDA unless --cpu (which checks this script itself on the CPU).

    source bench/gpu/gpu_env.sh && "$py" bench/gpu/gpu_smoke.py --out $OUT/gpu_smoke.json
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path

# cuBLAS needs this before CUDA starts to give repeatable matmuls (deterministic mode).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402

import dpadapter  # noqa: E402, F401
from dpadapter.algorithms import ALGORITHMS  # noqa: E402
from dpadapter.data import public_train  # noqa: E402
from dpadapter.ground import device as devices  # noqa: E402
from dpadapter.models import create_model, replace_head  # noqa: E402
from dpadapter.privacy import Segment, epsilon_from_history  # noqa: E402
from dpadapter.settings import SGDConfig, from_dict  # noqa: E402
from dpadapter.train.dp_fit import FitSettings, dp_fit  # noqa: E402
from dpadapter.train.dp_spec import run_spec  # noqa: E402
from dpadapter.train.loops import evaluate, robust_accuracy, sgd_train  # noqa: E402
from dpadapter.upstream import UPSTREAMS  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from tiny_config import TINY_RAW  # noqa: E402

MODES = ("hooks", "ew", "functorch", "bk")
CLASSES = 5
# Held-out accuracy a run must reach: the check is there to catch a run that learns nothing,
# which scores chance (1/CLASSES = 0.2, standard error 0.018 on 500 examples), so the floor is
# 0.3, over 5 standard errors above it. Forty noisy steps learn unevenly, GEP most: on the CPU in
# this script's setting (`--cpu`), over noise seeds 0-9 (2026-11-28), GEP scored 0.21-0.79 in
# hooks and 0.23-0.66 in ew, half its runs under the earlier floor of 0.4 and 2 in 10 under
# 0.3; the same seeds give each mode a different trajectory, since GEP's subspace amplifies
# rounding. The second H200 loan (2026-11-28) failed gep@ew at 0.218, 0.212 and 0.394 under the
# 0.4 floor while its self-test passed. A run below the floor is therefore trained again with
# other noise seeds (ACCURACY_SEEDS), and the check fails only when every seed stays below it: a
# run that learns nothing fails all five, a sound GEP run by chance about (2/10)^5 ~ 0.03 % of
# the time.
MIN_ACCURACY = 0.3
ACCURACY_SEEDS = (0, 1, 2, 3, 4)
NOISE_STD_TOLERANCE = 0.03  # |std of the normalised noise - 1|; thousands of draws per run


def synthetic(n: int, seed: int, side: int = 28, chans: int = 1) -> torch.utils.data.TensorDataset:
    """A learnable task: one fixed random image per class (the same for every split) plus noise."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, CLASSES, (n,), generator=g)
    templates = torch.randn(CLASSES, chans, side, side, generator=torch.Generator().manual_seed(99))
    x = templates[y] + 0.5 * torch.randn(n, chans, side, side, generator=g)
    return torch.utils.data.TensorDataset(x, y)


def smoke_config(device: str, mode: str = "ew"):
    raw = copy.deepcopy(TINY_RAW)
    raw.update({"device": device, "results_dir": "/tmp/gpu_smoke_results", "tf32": False})
    raw["model"] = {"name": "cnn-gn", "groups": 4, "width": 16}
    raw["finetune"].update({"batch_size": 100, "epochs": 2, "grad_sample_mode": mode})
    raw["finetune"]["pad_batches"] = "auto"
    # AdpClip's bound tracks the median per-example norm, far above the initial C = 1 here; at
    # this lr (set for C = 1) the larger steps undo the training: held-out accuracy 0.19 with
    # the default max_clip, 0.28 with max_clip 2, measured on the CPU. The smoke checks the
    # mechanism (two queries, the clip update, the noise), so C may only shrink from 1 here.
    raw["finetune"]["algo_params"] = {"adpclip": {"max_clip": 1.0}}
    return from_dict(raw)


@contextlib.contextmanager
def deterministic():
    """cuDNN's deterministic kernels, no autotuning, no TF32; restored afterwards."""
    cudnn = torch.backends.cudnn
    saved = (
        cudnn.deterministic,
        cudnn.benchmark,
        torch.backends.cuda.matmul.allow_tf32,
        cudnn.allow_tf32,
        torch.are_deterministic_algorithms_enabled(),
    )
    cudnn.deterministic = True
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        cudnn.deterministic, cudnn.benchmark = saved[0], saved[1]
        torch.backends.cuda.matmul.allow_tf32, cudnn.allow_tf32 = saved[2], saved[3]
        torch.use_deterministic_algorithms(saved[4])


# --- the checks: each returns None when it holds, else what is wrong ------------------------


def check_device(model: torch.nn.Module, batch_devices: set[str], dev: torch.device) -> str | None:
    off = {str(p.device) for p in model.parameters() if p.device.type != dev.type}
    if off or batch_devices - {dev.type}:
        return f"parameters on {sorted(off)}, batches on {sorted(batch_devices)}; want {dev.type}"
    return None


def check_shapes(shapes: set[tuple], padded: bool) -> str | None:
    if padded and len(shapes) != 1:
        return f"{len(shapes)} physical batch shapes, want one padded shape: {sorted(shapes)[:4]}"
    return None


def check_finite(model: torch.nn.Module) -> str | None:
    bad = [n for n, p in model.named_parameters() if not torch.isfinite(p).all()]
    return f"non-finite weights in {bad}" if bad else None


def check_accuracy(accuracy: float | list[float]) -> str | None:
    """Fails when every seed's held-out accuracy is below the floor (a list: one per seed)."""
    accs = accuracy if isinstance(accuracy, list) else [accuracy]
    if not max(accs) >= MIN_ACCURACY:
        got = ", ".join(f"{a:.3f}" for a in accs)
        seeds = f" with noise seeds {list(ACCURACY_SEEDS[: len(accs)])}" if len(accs) > 1 else ""
        return f"held-out accuracy {got}{seeds} < {MIN_ACCURACY} (chance {1 / CLASSES:.2f})"
    return None


def check_noise(audit: list, sigma: float | list[float]) -> tuple[str | None, dict]:
    """The noise added, as measured, against what was declared and what the ledger records."""
    if not audit:
        return "no release was audited", {}
    z = torch.cat(
        [(r.noise.double() / r.noise_std).reshape(-1).cpu() for s in audit for r in s.releases]
    )
    std, mean = float(z.std()), float(z.mean())
    stats = {"noise_draws": z.numel(), "noise_std_over_declared": round(std, 4)}
    if abs(std - 1) > NOISE_STD_TOLERANCE or abs(mean) > 5 / math.sqrt(z.numel()):
        return f"added noise has std {std:.4f} and mean {mean:.2g} x the declared std", stats
    # the accounted sigma of each release: one value, or the schedule's per release (AdpAlloc)
    planned = [sigma] * len(audit) if isinstance(sigma, (int, float)) else list(sigma)
    if len(planned) != len(audit):
        return f"{len(audit)} releases audited, {len(planned)} planned", stats
    for s, sigma in zip(audit, planned, strict=True):
        if not math.isclose(s.recorded_noise_multiplier, s.joint_noise_multiplier, rel_tol=1e-6):
            return (
                f"ledger records sigma {s.recorded_noise_multiplier:.6g}, the step's queries "
                f"give {s.joint_noise_multiplier:.6g}",
                stats,
            )
        if not math.isclose(s.recorded_noise_multiplier, sigma, rel_tol=1e-6):
            return (
                f"ledger records sigma {s.recorded_noise_multiplier:.6g}, calibrated {sigma}",
                stats,
            )
    return None, stats


def check_epsilon(ledger, spec) -> tuple[str | None, float]:
    hist = [Segment(**s) for s in ledger.state_dict()["history"]]
    eps = epsilon_from_history(hist, spec.delta, spec.accountant)
    if ledger.steps != spec.total_steps:
        return f"{ledger.steps} releases recorded, {spec.total_steps} planned", eps
    if not eps <= spec.target_epsilon * 1.001:
        return f"epsilon {eps:.4f} from the history exceeds the target {spec.target_epsilon}", eps
    return None, eps


def check_repeat(a: torch.nn.Module, b: torch.nn.Module) -> str | None:
    diff = max(
        float((x.float() - y.float()).abs().max())
        for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    )
    return None if diff == 0 else f"same seeds, weights differ by up to {diff:.3g}"


# --- runs -------------------------------------------------------------------------------------


def train_once(name: str, cfg, train, start: torch.nn.Module, dev: torch.device, seed: int = 0):
    """One DP fine-tuning run of the stage's own loop, with the algorithm's audit trail on."""
    spec = dataclasses.replace(run_spec(cfg, name, 2.0, len(train)), epochs=2)
    algo_cls = ALGORITHMS[name]
    seen: dict = {"shapes": set(), "devices": set(), "algo": None}
    original = algo_cls.train_step

    def spy(self, m, x, y, loss_fn):
        if self.audit is None:
            self.audit = []
            seen["algo"] = self
        seen["shapes"].add(tuple(x.shape))
        seen["devices"].add(x.device.type)
        return original(self, m, x, y, loss_fn)

    model = copy.deepcopy(start)
    algo_cls.train_step = spy
    t0 = time.time()
    try:
        settings = FitSettings.from_config(cfg)
        _, ledger = dp_fit(model, train, name, spec, settings, seed, public=public_train(cfg))
    finally:
        algo_cls.train_step = original
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return model, seen, ledger, spec, time.time() - t0


def check_algorithm(
    name: str,
    cfg,
    dev: torch.device,
    repeat: bool = True,
    n: int = 2000,
    side: int = 28,
    chans: int = 1,
    timm_args: dict | None = None,
    n_test: int = 500,
) -> dict:
    """Train `name` (twice when `repeat`) and run every check; `failures` lists what failed."""
    train, test = synthetic(n, 1, side, chans), synthetic(n_test, 2, side, chans)
    start = replace_head(create_model(cfg.model, CLASSES, chans, 0, timm_args), CLASSES, 0)
    with deterministic():
        model, seen, ledger, spec, wall = train_once(name, cfg, train, start, dev)
        again = train_once(name, cfg, train, start, dev)[0] if repeat else None
    padded = dev.type == "cuda" if cfg.finetune.pad_batches == "auto" else cfg.finetune.pad_batches
    accuracy = evaluate(model, test)
    accuracies = [accuracy]  # more noise seeds only while every one so far is below the floor
    for seed in ACCURACY_SEEDS[1:]:
        if max(accuracies) >= MIN_ACCURACY:
            break
        with deterministic():
            accuracies.append(evaluate(train_once(name, cfg, train, start, dev, seed)[0], test))
    algo = seen["algo"]
    steps = spec.steps_per_epoch
    schedule = [algo.noise_multiplier(i // steps) for i in range(len(algo.audit))]
    noise_problem, noise_stats = check_noise(algo.audit, schedule)
    eps_problem, eps = check_epsilon(ledger, spec)
    checks = {
        "device": check_device(model, seen["devices"], dev),
        "shapes": check_shapes(seen["shapes"], bool(padded)),
        "finite": check_finite(model),
        "accuracy": check_accuracy(accuracies),
        "noise": noise_problem,
        "epsilon": eps_problem,
        "repeat": check_repeat(model, again) if repeat else None,
    }
    return {
        "mode_run": algo.grad_sample_mode,
        "steps": ledger.steps,
        "epsilon": eps,
        "sigma": algo.sigma,
        "accuracy": accuracy,
        "accuracy_other_seeds": accuracies[1:],
        **noise_stats,
        "physical_shapes": sorted(seen["shapes"]),
        "wall_s": round(wall, 2),
        "failures": {k: v for k, v in checks.items() if v},
    }


# The external-backbone path of DP-SAT Table 3 at CIFAR size: a timm ViT built at 32x32 (patch 4:
# 64 tokens + the class token), trained with bk in bf16 autocast. Tiny: one block of width 32.
VIT = "timm:vit_tiny_patch16_224"
VIT_ARGS = {"img_size": 32, "patch_size": 4}
VIT_TINY_ARGS = {**VIT_ARGS, "depth": 1, "embed_dim": 32, "num_heads": 2}


def check_external(where: str, dev: torch.device, tiny: bool = False) -> dict:
    """DP-SGD on the ViT (bk, bf16), with the same checks as every algorithm, bar the repeat
    (bf16 autocast is not bit-reproducible across kernels) and the accuracy floor (a ViT from
    random weights learns too slowly in two epochs to be held to it; its accuracy is reported)."""
    cfg = smoke_config(where, "bk")
    raw_model = {"name": VIT, "batchnorm": "freeze"}
    cfg = dataclasses.replace(
        cfg,
        model=dataclasses.replace(cfg.model, **raw_model),
        finetune=dataclasses.replace(cfg.finetune, precision="bf16", lr=0.05),
    )
    args = VIT_TINY_ARGS if tiny else VIT_ARGS
    r = check_algorithm(
        "dpsgd",
        cfg,
        dev,
        repeat=False,
        n=300 if tiny else 2000,
        side=32,
        chans=3,
        timm_args=args,
        n_test=100 if tiny else 500,
    )
    r["failures"].pop("accuracy", None)
    r["model"] = f"{VIT} {args}"
    r["precision"] = "bf16"
    return r


def check_upstream(cfg, dev: torch.device, tiny: bool = False) -> dict:
    """Warm-up, then DPAdapter's Algorithm 1 (B1 gradient on the GPU) and robust accuracy."""
    public = synthetic(1500 if tiny else 3000, 3, 16 if tiny else 28)
    public = torch.utils.data.TensorDataset(*(t.to(dev) for t in public.tensors))
    model = create_model(cfg.model, CLASSES, 1, 0).to(dev)
    t0 = time.time()
    sgd_train(model, public, SGDConfig(epochs=1, batch_size=128, lr=0.05), seed=0)
    warm_s = time.time() - t0
    method = UPSTREAMS["dpadapter"](
        {
            "epochs": 1,
            "max_steps": 8 if tiny else 20,
            "m1": 256 if tiny else 1024,
            "m2": 64,
            "gamma": 0.5,
            "lr": 0.01,
            "milestones": [],
            "chunk_size": 256,
        }
    )
    dpa = copy.deepcopy(model)
    t0 = time.time()
    step = method.make_step(public, 0)
    sgd_train(dpa, public, method.sgd_config(), seed=0, step=step)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    test = synthetic(300 if tiny else 500, 4, 16 if tiny else 28)
    accuracy = evaluate(dpa, test)
    delta_dev = None if step.last_delta is None else step.last_delta[0].device.type
    checks = {
        "finite": check_finite(dpa),
        "accuracy": check_accuracy(accuracy),
        "device": None if delta_dev == dev.type else f"B1 perturbation on {delta_dev}",
    }
    return {
        "warmup_epoch_s": round(warm_s, 2),
        "dpadapter_20_steps_s": round(time.time() - t0, 2),
        "accuracy": accuracy,
        "robust_accuracy": robust_accuracy(dpa, test, 0.05, 2, 0),
        "failures": {k: v for k, v in checks.items() if v},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("gpu_smoke.json"))
    ap.add_argument("--cpu", action="store_true", help="check the script itself on a CPU")
    ap.add_argument("--tiny", action="store_true", help="small runs, no repeat: a smoke of this")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--algorithms", nargs="+", default=sorted(ALGORITHMS))
    ap.add_argument("--parts", nargs="+", default=["algorithms", "upstream", "external"])
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() and not args.cpu:
        print("gpu_smoke: no CUDA device here; run it on a GPU node", file=sys.stderr)
        return 2
    where = "cpu" if args.cpu else "cuda"
    dev = devices.resolve(where)
    report: dict = {"device": devices.describe(dev), "runs": {}, "failures": {}}
    size = {"n": 1000, "side": 16, "n_test": 300, "repeat": False} if args.tiny else {}

    def save() -> None:  # after every run: a run cut at a deadline keeps what it had
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2, default=str) + "\n")

    def record(key: str, fn) -> None:
        try:
            r = fn()
        except Exception as exc:  # keep going: the report lists every failure
            report["failures"][key] = {"crash": repr(exc)}
            print(f"{key}: CRASH {exc!r}", flush=True)
        else:
            report["runs"][key] = r
            if r["failures"]:
                report["failures"][key] = r["failures"]
            print(f"{key}: {'ok' if not r['failures'] else r['failures']}", flush=True)
        save()

    if "algorithms" in args.parts:
        for mode in args.modes:
            cfg = smoke_config(where, mode)
            for name in args.algorithms:
                record(f"{name}@{mode}", lambda n=name, c=cfg: check_algorithm(n, c, dev, **size))
    if "upstream" in args.parts:
        record("upstream", lambda: check_upstream(smoke_config(where), dev, args.tiny))
    if "external" in args.parts:
        record("external-vit@bk-bf16", lambda: check_external(where, dev, args.tiny))
    report["done"] = True
    save()
    bad = report["failures"]
    print("gpu_smoke:", f"FAILED {len(bad)}: " + json.dumps(bad) if bad else "all checks passed")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
