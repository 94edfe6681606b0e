"""The per-sample self-test at DP-SAT Table 2's batch, module by module, on any device.

    python bench/gpu/gpu_self_test.py --device cuda --out $OUT/self_test.json   # on a GPU
    python bench/gpu/gpu_self_test.py --device cpu --out FILE.json              # the same here

Why (issue 66): in every Table 2 cell on an H200 the self-test's deciding check used 80 % of
its tolerance (bk's per-example norms at GNResNet-10's `layers.3.gn1`, 9.1e-4 against 1e-3),
where the CPU at the same batch used 2 %. A cell's metrics.json keeps the deciding check only.
This runs the self-test as a Table 2 cell does (`wrap_for_dp` on GNResNet-10, groups 16, width
64, Fashion-MNIST's 1x28x28 samples, 1152 examples, full FP32) in each mode asked for, and
writes every module's worst per-example error and the example it belongs to, for the mode and
for the torch.func reference in float32, both against the float64 reference
(`per_sample.margins`), with how bk computed that layer. On the GPU session it is the step
`self_test` (bench/gpu/gpu_session.py), its file `self_test.json` in $OUT; run here, the same
command gives the CPU's figures beside which a loan's are read (docs/gpu-runs/).

The device is configured as a training job configures it (`device.configure`: cuDNN
autotuning on CUDA, so the self-test's batched backward runs the algorithms the autotuner picks
at this batch shape, as in a cell). A mode may carry a variant, `MODE@VARIANT`, which changes
only the cuDNN flags around its self-test: `heuristic` (autotuning off: cuDNN's heuristic
algorithm for each shape) and `no-cudnn` (torch's own convolution kernels). The float32
formula of bk's GroupNorm kernel at this model's inputs is ~1e-7 off on the CPU, in CUDA's
accumulation order too (docs/gpu.md "Unmeasured"), which leaves the algorithms cuDNN picks for
the batched backward at 1152 examples (the reference runs chunks of a few examples, the small
check 5): if `bk` is far off and `bk@heuristic` / `bk@no-cudnn` are not, and `hooks` (the same
batched backward) is off at the same modules, the autotuned algorithm is the cause; if `bk`
alone is off whatever the flags, bk's own kernels are.

A refused test is recorded too (its record rides on the `PerSampleCheckError`): the point is
the figures, and a cell that refuses one mode runs in another anyway.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
BATCH = 1152  # configs/dpsat-table2.yaml's physical batch (docs/gpu.md)
SHOWN = 6  # modules listed worst first in the summary


def commit() -> str | None:
    """The tree's commit where it is a git checkout (a loan's copy is not: `GIT_COMMIT`)."""
    try:
        out = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
            capture_output=True, text=True, timeout=10,
        )  # fmt: skip
        dirty = subprocess.run(
            ["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True, text=True, timeout=10,
        ).stdout.strip()  # fmt: skip
        if out.returncode == 0:
            return out.stdout.strip() + ("+changes" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return os.environ.get("GIT_COMMIT")


def machine(device: str) -> dict:
    out = {
        "host": platform.node(),
        "cpu": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(0)
        out.update(card=props.name, cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version())
    return out


def _cudnn(**changed):
    """cuDNN's flags as they are but `changed` (`torch.backends.cudnn.flags` sets every flag it
    takes, TF32 on by default: the self-test's `full_fp32` turns it off inside anyway)."""
    cudnn = torch.backends.cudnn
    now = dict(enabled=cudnn.enabled, benchmark=cudnn.benchmark,
               deterministic=cudnn.deterministic, allow_tf32=cudnn.allow_tf32)  # fmt: skip
    return cudnn.flags(**{**now, **changed})


VARIANTS = {
    "": nullcontext,
    "heuristic": lambda: _cudnn(benchmark=False),
    "no-cudnn": lambda: _cudnn(enabled=False),
}


def run_mode(spec: str, args: argparse.Namespace) -> dict:
    """One `MODE[@VARIANT]`'s self-test record (passed or refused), with its wall time."""
    from dpadapter.ground.device import configure
    from dpadapter.models.factory import create_model
    from dpadapter.per_sample import PerSampleCheckError, wrap_for_dp
    from dpadapter.settings import ModelConfig

    mode, _, variant = spec.partition("@")
    cfg = ModelConfig(name="gnresnet10", groups=args.groups, width=args.width)
    device = torch.device(args.device)
    configure(device)  # as a training job: cuDNN autotuning on CUDA
    model = create_model(cfg, 10, 1, seed=args.seed).to(device)
    t0 = time.monotonic()
    with VARIANTS[variant]():
        flags = {
            "cudnn_enabled": torch.backends.cudnn.enabled,
            "cudnn_benchmark": torch.backends.cudnn.benchmark,
        }
        try:
            wrapped = wrap_for_dp(
                model, mode, sample=((1, 28, 28), torch.float32), check_batch=args.batch
            )
            record, refused = wrapped.per_sample_check, None
        except PerSampleCheckError as exc:
            record, refused = exc.record, str(exc)
    wall = round(time.monotonic() - t0, 1)
    return {"wall_s": wall, "flags": flags, "refused": refused, "record": record}


def worst_first(record: dict | None) -> list[tuple[str, dict]]:
    rows = (record or {}).get("by_module", {})
    return sorted(rows.items(), key=lambda kv: -kv[1]["mode_error"])


def summary(result: dict) -> str:
    """The modules nearest to failing in each mode, one line each (the JSON has them all)."""
    lines = []
    for mode, res in result["modes"].items():
        rec = res["record"] or {}
        lines.append(
            f"{mode}: passed={rec.get('passed')} worst={rec.get('worst')} "
            f"measured={rec.get('worst_rel_error', float('nan')):.3g} "
            f"allowance={rec.get('rounding_allowance', float('nan')):.3g} ({res['wall_s']} s)"
        )
        for mod, row in worst_first(rec)[:SHOWN]:
            lines.append(
                f"  {mod}: mode {row['mode_error']:.3g} at example {row['mode_example']}"
                f" (norm {row['norm']:.3g} of {row['whole_norm']:.3g}; reference there"
                f" {row.get('reference_error_at_mode_example', float('nan')):.3g});"
                f" reference worst {row.get('reference_error', float('nan')):.3g} at"
                f" {row.get('reference_example')}; {row.get('how', '')}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, default=BATCH)
    ap.add_argument(
        "--modes", nargs="+", default=["bk", "hooks", "bk@heuristic", "bk@no-cudnn"],
        help="MODE or MODE@VARIANT (heuristic, no-cudnn), in this order (a cut keeps the first)",
    )  # fmt: skip
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0, help="the model's initialisation")
    ap.add_argument("--tiny", action="store_true", help="width 8, groups 4 (the dry run)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    unknown = [m for m in args.modes if m.partition("@")[2] not in VARIANTS]
    if unknown:
        ap.error(f"unknown variant in {unknown}; known: {[v for v in VARIANTS if v]}")
    if args.tiny:
        args.groups, args.width = 4, 8
    result = {
        "what": "per-sample self-test, each module's worst example (bench/gpu/gpu_self_test.py)",
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit(),
        "machine": machine(args.device),
        "command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
        "device": args.device,
        "model": dict(name="gnresnet10", groups=args.groups, width=args.width, seed=args.seed),
        "examples": args.batch,
        "modes": {},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for mode in args.modes:
        result["modes"][mode] = run_mode(mode, args)
        # after each mode: a cut step keeps what finished
        args.out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(summary(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
