"""GPU smoke test: every stage and every registered algorithm on CUDA for a few steps, checked.

Checks, per algorithm, in the config's per-sample mode and in `bk`: the model's parameters and
the mechanism's noise generator live on the GPU; physical batches have one fixed (padded) shape;
the ledger has one record per release and epsilon recomputed from the recorded history equals
the reported one and stays within the target; the run is repeatable (same seed, same weights).
Then warm-up, DPAdapter (B1 gradient on the GPU) and robust accuracy on CUDA. Prints a JSON
report and writes it to --out.

    python bench/gpu_smoke.py --out $OUT/gpu_smoke.json     # bench/gpu_smoke.sh wraps it

On a machine without CUDA it refuses (exit 2) instead of silently testing the CPU.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

import dpadapter  # noqa: F401
from dpadapter import device as devices
from dpadapter.algorithms import ALGORITHMS
from dpadapter.config import SGDConfig, from_dict
from dpadapter.models import create_model, replace_head
from dpadapter.privacy import Segment, epsilon_from_history
from dpadapter.stages.finetune import dp_train, run_spec
from dpadapter.train.loops import evaluate, robust_accuracy, sgd_train
from dpadapter.upstream import UPSTREAMS

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from tiny_config import TINY_RAW  # noqa: E402


def _synthetic(n: int, classes: int, seed: int, side: int = 28):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, classes, (n,), generator=g)
    x = torch.randn(n, 1, side, side, generator=g) * 0.5
    x[:, 0, :classes, 0] += torch.nn.functional.one_hot(y, classes).float() * 3  # learnable
    return torch.utils.data.TensorDataset(x, y)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def check_algorithm(name: str, cfg, dev: torch.device) -> dict:
    train = _synthetic(2000, 5, 1)
    spec = dataclasses.replace(run_spec(cfg, name, 2.0, len(train)), epochs=2)
    shapes: set[tuple] = set()
    start = replace_head(create_model(cfg.model, 5, 1, 0), 5, 0)
    out = []
    for _ in range(2):
        model = copy.deepcopy(start)
        algo = ALGORITHMS[name]
        original = algo.train_step

        def spy(self, m, x, y, loss_fn, _orig=original):
            shapes.add(tuple(x.shape))
            assert x.device.type == dev.type, x.device
            return _orig(self, m, x, y, loss_fn)

        algo.train_step = spy
        t0 = time.time()
        try:
            run, ledger = dp_train(model, train, name, spec, cfg, seed=0)
        finally:
            algo.train_step = original
        _sync(dev)
        out.append((model, run, ledger, time.time() - t0))
    (m1, run, ledger, wall), (m2, _, _, _) = out
    assert all(p.device.type == dev.type for p in m1.parameters())
    assert run.generator.device.type == dev.type
    hist = [Segment(**s) for s in ledger.state_dict()["history"]]
    eps = epsilon_from_history(hist, spec.delta, spec.accountant)
    assert ledger.steps == spec.total_steps and eps <= spec.target_epsilon * 1.001
    same = all(
        torch.equal(a, b)
        for a, b in zip(m1.state_dict().values(), m2.state_dict().values(), strict=True)
    )
    return {
        "steps": ledger.steps,
        "epsilon": eps,
        "sigma": run.sigma,
        "physical_shapes": sorted(shapes),
        "repeatable": same,
        "wall_s": round(wall, 2),
        "accuracy": evaluate(m1, _synthetic(500, 5, 2)),
    }


def check_upstream(cfg, dev: torch.device) -> dict:
    public = _synthetic(3000, 5, 3)
    public = torch.utils.data.TensorDataset(*(t.to(dev) for t in public.tensors))
    model = create_model(cfg.model, 5, 1, 0).to(dev)
    t0 = time.time()
    sgd_train(model, public, SGDConfig(epochs=1, batch_size=128, lr=0.05), seed=0)
    warm_s = time.time() - t0
    method = UPSTREAMS["dpadapter"](
        {
            "epochs": 1,
            "max_steps": 20,
            "m1": 1024,
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
    _sync(dev)
    test = _synthetic(500, 5, 4)
    return {
        "warmup_epoch_s": round(warm_s, 2),
        "dpadapter_20_steps_s": round(time.time() - t0, 2),
        "b1_delta_device": None if step.last_delta is None else str(step.last_delta[0].device),
        "accuracy": evaluate(dpa, test),
        "robust_accuracy": robust_accuracy(dpa, test, 0.05, 2, 0),
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("gpu_smoke.json"))
    ap.add_argument("--cpu", action="store_true", help="check the script itself on a CPU")
    args = ap.parse_args()
    if not torch.cuda.is_available() and not args.cpu:
        print("gpu_smoke: no CUDA device here; run it on a GPU node", file=sys.stderr)
        return 2
    raw = copy.deepcopy(TINY_RAW)
    raw.update({"device": "cpu" if args.cpu else "cuda", "results_dir": "/tmp/gpu_smoke_results"})
    raw["model"] = {"name": "cnn-gn", "groups": 4, "width": 16}
    raw["finetune"].update({"batch_size": 100, "epochs": 2})
    cfg = from_dict(raw)
    dev = devices.resolve(cfg.device)
    devices.configure(dev, cfg.tf32)
    report = {"device": devices.describe(dev), "algorithms": {}, "failures": {}}
    # Each algorithm in the default per-sample mode and in `bk` (hand-written book-keeping
    # clipping, whose CUDA path no test in CI can run).
    bk_cfg = dataclasses.replace(
        cfg, finetune=dataclasses.replace(cfg.finetune, grad_sample_mode="bk")
    )
    for name in sorted(ALGORITHMS):
        for key, run_cfg in ((name, cfg), (f"{name}@bk", bk_cfg)):
            try:
                report["algorithms"][key] = check_algorithm(name, run_cfg, dev)
            except Exception as exc:  # keep going: the report lists every failure
                report["failures"][key] = repr(exc)
    try:
        report["upstream"] = check_upstream(cfg, dev)
    except Exception as exc:
        report["failures"]["upstream"] = repr(exc)
    text = json.dumps(report, indent=2, default=str)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text + "\n")
    bad = dict(report["failures"])
    for name, r in report["algorithms"].items():
        one_shape = len(r["physical_shapes"]) == 1 or dev.type == "cpu"  # CPU: unpadded
        if not r["repeatable"] or not one_shape:
            bad[name] = f"repeatable={r['repeatable']} shapes={r['physical_shapes']}"
    print("gpu_smoke:", "FAILED " + json.dumps(bad) if bad else "all checks passed")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
