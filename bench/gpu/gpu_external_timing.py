"""Time DP fine-tuning steps of DP-SAT Table 3's backbones; project the table's device-hours.

Each backbone (random weights: timing needs no hub download) sits behind the input adapter of
`configs/dpsat-table3.yaml` (32x32 CIFAR images resized to 224 / 240 on the device, ImageNet
mean/std) and trains through `train.dp_fit` on synthetic 3x32x32 data at the config's shapes:
expected batch 1000 (q = 1000 / 40,000), physical batches of 100, Adam, C = 0.1, DP-SAT, in each
`--modes` x `--precisions`. Per backbone and setting: seconds per logical step (after the
first, which pays cuDNN autotuning and allocation), peak GPU memory, and the projected hours of
its jobs in the table (200 steps per job; 20 jobs per budget: 2 datasets x 2 algorithms x
5 seeds; DeiT/ViT/CrossViT-18 run at both budgets, the others at one).

    python bench/gpu/gpu_external_timing.py --out $OUT/external_timing.json  # on the GPU
    python bench/gpu/gpu_external_timing.py --quick                          # check it runs (CPU)
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.data import TensorDataset

import dpadapter.models  # noqa: F401  (torchvision ops shim before timm)
from dpadapter.algorithms import DPRunSpec
from dpadapter.models.input_adapter import AdapterSpec, adapt
from dpadapter.train.dp_fit import FitSettings, dp_fit

IMAGENET = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
# (timm name, input side, jobs in the table): first block 3 models x 2 budgets, second 5 x 1
BACKBONES = (
    ("crossvit_tiny_240", 240, 20),
    ("crossvit_small_240", 240, 20),
    ("crossvit_18_240", 240, 40),
    ("vit_small_patch16_224", 224, 40),
    ("deit_base_patch16_224", 224, 40),
)
STEPS_PER_JOB = 200  # 40,000 examples, q = 1/40, 5 epochs


def build(name: str, side: int, num_classes: int, timm_args: dict) -> torch.nn.Module:
    import timm

    backbone = timm.create_model(name, pretrained=False, num_classes=num_classes, **timm_args)
    return adapt(backbone, AdapterSpec(size=side, channels=3, mean=IMAGENET[0], std=IMAGENET[1]))


def time_steps(model, n, batch, physical, mode, precision, steps, device) -> dict:
    x = torch.rand(n, 3, 32, 32)
    y = torch.randint(0, 10, (n,))
    spec = DPRunSpec(
        target_epsilon=2.0,
        delta=1e-5,
        sample_rate=batch / n,
        steps_per_epoch=n // batch,
        epochs=max(1, -(-(steps + 1) * batch // n)),
        expected_batch_size=batch,
        max_grad_norm=0.1,
        accountant="rdp",
        params={"rho": 0.05},
        calibration_cache=str(Path(tempfile.gettempdir()) / "external_timing_sigma.json"),
    )
    settings = FitSettings(
        lr=0.002,
        momentum=0.0,
        grad_sample_mode=mode,
        physical_batch_size=physical,
        pad_batches="auto",
        device=device,
        tf32=True,
        optimizer="adam",
        precision=precision,
    )
    stamps: dict[int, float] = {}  # ledger steps -> when the loop first saw that many
    import dpadapter.train.dp_fit as fit

    original = fit.ProgressLine.step

    def step(self, steps, loss=None):
        if steps not in stamps:
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            stamps[steps] = time.perf_counter()
        return original(self, steps, loss)

    fit.ProgressLine.step = step
    try:
        if device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
        dp_fit(model, TensorDataset(x, y), "dpsat", spec, settings, 0, max_steps=steps + 2)
    finally:
        fit.ProgressLine.step = original
    times = [stamps[k] for k in sorted(stamps)]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    return {
        "s_per_step": sum(gaps[1:]) / max(1, len(gaps) - 1) if len(gaps) > 1 else None,
        "steps_timed": max(0, len(gaps) - 1),
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30
        if device.startswith("cuda")
        else None,
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--modes", default="bk")
    ap.add_argument("--precisions", default="fp32,bf16")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="tiny shapes on the CPU (a check)")
    args = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    n, batch, physical = 40_000, 1000, 100
    backbones, timm_args = BACKBONES, {}
    if args.quick:
        n, batch, physical = 64, 16, 8
        backbones = (("vit_tiny_patch16_224", 32, 1),)
        timm_args = {"img_size": 32, "patch_size": 8, "depth": 1}
    rows = []
    for name, side, jobs in backbones:
        for mode in args.modes.split(","):
            for precision in args.precisions.split(","):
                model = build(name, side, 10, timm_args)
                r = time_steps(model, n, batch, physical, mode, precision, args.steps, device)
                hours = None
                if r["s_per_step"] is not None:
                    hours = r["s_per_step"] * STEPS_PER_JOB * jobs / 3600
                rows.append(
                    {"backbone": name, "mode": mode, "precision": precision, **r, "jobs": jobs}
                    | {"projected_hours": hours}
                )
                print(json.dumps(rows[-1]), flush=True)
                del model
                if device.startswith("cuda"):
                    torch.cuda.empty_cache()
    out = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "rows": rows,
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main()
