"""DP-SGD step / non-private step for every per-sample clipping mode, side by side, one process.

For each model (issue 12's table: ResNet20-GN 3x32x32 batch 256, GNResNet-10 1x28x28 logical
batch 2048, the embedded CNN `cnn-gn` width 16 batch 200) and each mode:

- `nonprivate`: plain SGD on the same physical batches (the baseline of every ratio);
- `hooks`:     Opacus GradSampleModule, per-layer per-sample gradients from forward/backward hooks;
- `functorch`: Opacus GradSampleModule with `force_functorch` (vmap(grad) per layer);
- `ew`:        Opacus expanded weights (torch's per-sample gradients inside autograd);
- `ghost`:     Opacus fast gradient clipping with ghost norms (GradSampleModuleFastGradientClipping
               + `DPOptimizerFastGradientClipping` + `DPLossFastGradientClipping`): per-sample
               gradient *norms* in a first backward (ghost norms for Linear/Embedding, per-sample
               gradients then their norms elsewhere), the clipped sum from a second, reweighted
               backward; per-sample gradients are never stored;
- `fgc`:       the same without ghost norms (per-sample gradient norms of every layer);
- `bk`:        the pipeline's book-keeping path (`finetune.grad_sample_mode: bk`,
               dpadapter.per_sample.bookkeeping): one backward without the weights' unclipped
               gradients, per-layer norms by ghost norm or per-example gradient (whichever is
               cheaper), the clipped sum as one weight-gradient kernel per layer;
- `bk-compiled`: the same with `finetune.compile` (dpadapter.per_sample.compiled): the forward and
               backward, recording included, through `torch.compile` (`--compile-mode`,
               `--compile-backend`); norms, sums and noise eager;
- `nonprivate-compiled`: the non-private step with `torch.compile(model)`, the same mode and
               backend: `bk-compiled`'s like-for-like baseline (its ratio is printed against the
               eager non-private step, as every mode's).

A DP step is one logical batch: its physical batches each forward/backward and clip-accumulate,
then the noise and the update. The non-private step goes through the same physical batches and
the same eager execution (only the two `-compiled` modes compile), so the ratios compare like
with like. Steps are timed round-robin over the modes (one step of each mode per round) so that a
change in machine load hits every mode alike; the figure is the median over rounds. Before each
timed step, `--settle` untimed steps (default 1) of the same mode run: a training job runs one
mode step after step, so what it pays is a step that follows its own mode. (This did not remove
the spread of the small CPU figures: cnn-gn's `bk` ratio moves 1.2-1.9x between identical
processes either way; docs/speed.md measures it over several processes.) On CUDA each
step is synchronised, and the peak memory allocated during a mode's steps is reported.

Correctness: before timing, every DP mode's clipped gradient sum (`p.summed_grad`, noise 0) on a
small batch is compared with a per-example reference (one forward/backward per example, each
gradient clipped to C, summed); C is the median per-example norm, so half the examples are
clipped. A mode that disagrees beyond float tolerance fails the run (exit code 1).

    .venv/bin/python bench/cpu/dp_modes.py [--device cpu|cuda] [--models ...] [--modes ...]
        [--steps 20] [--warmup 3] [--threads N] [--out DIR] [--tiny]

`--tiny` shrinks batches for a smoke run (CI, a busy machine); its timings mean nothing.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import platform
import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import opacus
import torch
from opacus.grad_sample import GradSampleModuleFastGradientClipping
from opacus.grad_sample.utils import wrap_model
from opacus.optimizers import DPOptimizer, DPOptimizerFastGradientClipping
from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping
from torch import nn

import dpadapter  # noqa: F401  (torchvision compatibility shim before any model import)
from dpadapter.models import create_model
from dpadapter.per_sample import dp_optimizer, wrap_for_dp
from dpadapter.per_sample.compiled import CompiledBookKeeping
from dpadapter.settings import ModelConfig

# Opacus' hooks on a first layer whose input needs no gradient; harmless and the same every step.
warnings.filterwarnings("ignore", message="Full backward hook is firing")

DP_MODES = ("hooks", "functorch", "ew", "ghost", "fgc", "bk", "bk-compiled")
# the modes run unless --modes names others (compiling takes minutes on the CPU: opt-in)
DEFAULT_MODES = tuple(m for m in DP_MODES if m != "bk-compiled")
BASELINES = ("nonprivate", "nonprivate-compiled")
# torch.compile's settings for the `-compiled` modes (--compile-mode, --compile-backend)
COMPILE = {"mode": "default", "backend": "inductor"}


@dataclass(frozen=True)
class Setting:
    model: ModelConfig
    shape: tuple[int, int, int]
    batch: int  # logical batch (one DP release)
    physical: dict[str, int]  # physical batch per device type (memory); divides `batch`
    classes: int = 10


SETTINGS = {
    "resnet20-gn": Setting(
        ModelConfig("resnet20-gn", 16, 16), (3, 32, 32), 256, {"cpu": 256, "cuda": 256}
    ),
    "gnresnet10": Setting(
        ModelConfig("gnresnet10", 16, 64), (1, 28, 28), 2048, {"cpu": 256, "cuda": 512}
    ),
    "cnn-gn": Setting(ModelConfig("cnn-gn", 8, 16), (1, 28, 28), 200, {"cpu": 200, "cuda": 200}),
    "dpnas-mnist": Setting(
        ModelConfig("dpnas-mnist", 8, 16), (1, 28, 28), 2048, {"cpu": 256, "cuda": 512}
    ),
}
DEFAULT_MODELS = ("resnet20-gn", "gnresnet10", "cnn-gn")


class Runner:
    """One mode's model, optimizer and `step(x, y)` over a logical batch split in chunks."""

    def __init__(
        self,
        mode: str,
        base: nn.Module,
        batch: int,
        physical: int,
        c: float,
        foreach: bool | None = None,  # SGD's own default: one `_foreach` call on CUDA only
    ):
        self.mode, self.physical = mode, physical
        model = copy.deepcopy(base)
        ce = nn.CrossEntropyLoss(reduction="mean")
        self.loss_fn = ce
        if mode in BASELINES:
            self.model = model if mode == "nonprivate" else torch.compile(model, **COMPILE)
            self.opt = torch.optim.SGD(model.parameters(), lr=0.0, foreach=foreach)
            return
        if mode in ("ghost", "fgc"):
            self.model = GradSampleModuleFastGradientClipping(
                model,
                batch_first=True,
                loss_reduction="mean",
                max_grad_norm=c,
                use_ghost_clipping=mode == "ghost",
            )
            opt_cls = DPOptimizerFastGradientClipping
        elif mode == "bk":
            self.model = wrap_for_dp(model, "bk")
            opt_cls = DPOptimizer
        elif mode == "bk-compiled":
            self.model = CompiledBookKeeping(model, loss_reduction="mean", **COMPILE)
            opt_cls = DPOptimizer
        else:
            self.model = wrap_model(
                model, grad_sample_mode=mode, batch_first=True, loss_reduction="mean"
            )
            opt_cls = DPOptimizer
        self.opt = dp_optimizer(
            opt_cls,
            self.model,
            torch.optim.SGD(self.model.parameters(), lr=0.0, foreach=foreach),
            noise_multiplier=0.0,  # noise costs the same in every mode; 0 keeps the check exact
            max_grad_norm=c,
            expected_batch_size=batch,
            loss_reduction="mean",
        )
        if mode in ("ghost", "fgc"):
            self.loss_fn = DPLossFastGradientClipping(self.model, self.opt, ce, "mean")

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        n = len(y)
        chunks = range(0, n, self.physical)
        if self.mode in BASELINES:
            self.opt.zero_grad(set_to_none=True)
            for i in chunks:
                xc, yc = x[i : i + self.physical], y[i : i + self.physical]
                (self.loss_fn(self.model(xc), yc) * (len(yc) / n)).backward()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            return
        for k, i in enumerate(chunks):
            xc, yc = x[i : i + self.physical], y[i : i + self.physical]
            self.loss_fn(self.model(xc), yc).backward()
            self.opt.signal_skip_step(do_skip=k < len(chunks) - 1)
            self.opt.step()
            if k < len(chunks) - 1:
                self.opt.zero_grad(set_to_none=True)

    def release(self) -> None:
        """Free what the step left (per-sample gradients, summed grads) before the next mode."""
        self.opt.zero_grad(set_to_none=True)

    def clipped_sum(self) -> torch.Tensor:
        return torch.cat([p.summed_grad.reshape(-1) for p in self.opt.params])


def reference_clipped_sum(
    base: nn.Module, x: torch.Tensor, y: torch.Tensor, c: float | None
) -> tuple[torch.Tensor, float]:
    """Per-example loop: each example's gradient clipped to C (Opacus' factor), then summed.

    With `c=None` the median per-example norm is used (and returned), so half are clipped.
    """
    model = copy.deepcopy(base)
    grads = []
    for i in range(len(y)):
        model.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x[i : i + 1]), y[i : i + 1]).backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    g = torch.stack(grads)
    norms = g.norm(dim=1)
    if c is None:
        c = float(norms.median())
    factor = (c / (norms + 1e-6)).clamp(max=1.0)
    return (g * factor[:, None]).sum(0), c


def check_modes(
    base: nn.Module, modes: list[str], x: torch.Tensor, y: torch.Tensor, physical: int
) -> dict[str, float]:
    """Relative L2 error of each DP mode's clipped sum against the per-example reference.

    In float64: in float32 the batched and the per-example convolutions of a deep network differ
    by ~1e-4 relative through summation order alone, which would hide a real mismatch.
    """
    base, x = copy.deepcopy(base).double(), x.double()
    ref, c = reference_clipped_sum(base, x, y, None)
    errors = {}
    for mode in (m for m in modes if m not in BASELINES):
        r = Runner(mode, base, len(y), physical, c)
        r.step(x, y)
        got = r.clipped_sum()
        errors[mode] = float((got - ref).norm() / ref.norm())
        r.release()
    return errors


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_model(name: str, args: argparse.Namespace, device: torch.device) -> dict:
    s = SETTINGS[name]
    if name in args.batch:  # the logical batch of this run (its physical one at most that)
        s = dataclasses.replace(
            s,
            batch=args.batch[name],
            physical={k: min(v, args.batch[name]) for k, v in s.physical.items()},
        )
    if args.tiny:  # narrow too: the smoke checks the script, and a deep float64 loop is slow
        s = dataclasses.replace(s, model=dataclasses.replace(s.model, groups=4, width=8))
    batch = args.tiny_batch if args.tiny else s.batch
    physical = min(batch, args.tiny_batch if args.tiny else s.physical[device.type])
    if batch % physical:
        raise SystemExit(f"{name}: physical batch {physical} does not divide {batch}")
    base = create_model(s.model, s.classes, s.shape[0], seed=0).to(device)
    n_params = sum(p.numel() for p in base.parameters())
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, *s.shape, generator=g).to(device)
    y = torch.randint(0, s.classes, (batch,), generator=g).to(device)
    out: dict = {
        "model": name,
        "params": n_params,
        "input": "x".join(map(str, s.shape)),
        "batch": batch,
        "physical_batch": physical,
    }

    if args.check:
        n = min(args.check_batch, batch)
        errors = check_modes(base, args.modes, x[:n], y[:n], max(1, n // 2))
        out["check"] = {
            "batch": n,
            "physical_batch": max(1, n // 2),
            "rel_error": errors,
            "tolerance": args.tol,
            "ok": all(e <= args.tol for e in errors.values()),
        }

    modes = ["nonprivate", *(m for m in args.modes if m != "nonprivate")]
    # The clipping bound matters only for which examples are clipped, not for speed.
    runners = {m: Runner(m, base, batch, physical, 1.0) for m in modes}
    times: dict[str, list[float]] = {m: [] for m in modes}
    peak: dict[str, int] = dict.fromkeys(modes, 0)
    extra: dict[str, int] = dict.fromkeys(modes, 0)
    for r in range(args.warmup + args.steps):
        for m in modes:
            for _ in range(args.settle):  # untimed: this mode's caches and allocations back
                runners[m].step(x, y)
                runners[m].release()
            _sync(device)
            if device.type == "cuda":
                before = torch.cuda.memory_allocated(device)
                torch.cuda.reset_peak_memory_stats(device)
            t = time.perf_counter()
            runners[m].step(x, y)
            _sync(device)
            dt = time.perf_counter() - t
            if device.type == "cuda":
                p = torch.cuda.max_memory_allocated(device)
                peak[m] = max(peak[m], p)
                extra[m] = max(extra[m], p - before)
            runners[m].release()
            if r >= args.warmup:
                times[m].append(dt)
    base_ms = 1000 * statistics.median(times["nonprivate"])
    out["modes"] = {}
    for m in modes:
        ms = 1000 * statistics.median(times[m])
        row = {
            "median_ms": round(ms, 3),
            "min_ms": round(1000 * min(times[m]), 3),
            "ratio": round(ms / base_ms, 3),
        }
        if device.type == "cuda":
            row["peak_mem_mib"] = round(peak[m] / 2**20, 1)
            row["step_mem_mib"] = round(extra[m] / 2**20, 1)
        out["modes"][m] = row
    if args.profile:
        for m in modes:
            out["modes"][m]["profile"] = profile_step(runners[m], x, y, device)
            runners[m].release()
    return out


def profile_step(runner: Runner, x: torch.Tensor, y: torch.Tensor, device: torch.device) -> dict:
    """One step under torch's profiler: the kernels it launched on the GPU and their summed time
    (on the CPU: the ATen ops it ran, a proxy; `bench/cpu/op_count.py` counts those without the
    profiler). A launch-bound step shows many kernels of a few microseconds each."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    runner.step(x, y)  # untimed: caches warm
    runner.release()
    _sync(device)
    with profile(activities=acts) as prof:
        runner.step(x, y)
        _sync(device)
    events = prof.events()
    if device.type == "cuda":
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        busy_us = sum(e.device_time for e in kernels)
        what = "cuda_kernels"
    else:
        kernels = [e for e in events if e.name.startswith("aten::") and e.cpu_parent is None]
        busy_us = sum(e.cpu_time_total for e in kernels)
        what = "cpu_top_level_aten_ops"
    return {
        "what": what,
        "count": len(kernels),
        "busy_ms": round(busy_us / 1000, 3),
        "us_per_kernel": round(busy_us / max(len(kernels), 1), 2),
    }


def markdown(report: dict) -> str:
    modes = ["nonprivate", *report["args"]["modes"]]
    cuda = report["device"].startswith("cuda")
    lines = [
        f"device: {report['device_name']}, torch {report['torch']}, opacus {report['opacus']}, "
        f"threads {report['threads']}, median of {report['args']['steps']} steps"
        f" (settle {report['args'].get('settle', 0)})"
        + (" (TINY smoke run: timings mean nothing)" if report["args"]["tiny"] else ""),
        "",
        "| model (input, batch / physical) | " + " | ".join(modes) + " | check |",
        "|---|" + "---|" * (len(modes) + 1),
    ]
    for r in report["results"]:
        cells = []
        chk = r.get("check")
        for m in modes:
            row = r["modes"][m]
            cell = f"{row['median_ms']:.1f} ms" if m == "nonprivate" else f"{row['ratio']:.2f}x"
            if chk is not None and m in chk["rel_error"]:  # this mode's clipped sum vs the loop
                err = chk["rel_error"][m]
                cell += f" (sum {'ok' if err <= chk['tolerance'] else 'WRONG'} {err:.0e})"
            if cuda:
                cell += f" ({row['peak_mem_mib']:.0f} MiB)"
            cells.append(cell)
        ok = "-" if chk is None else ("ok" if chk["ok"] else "FAILED")
        label = f"{r['model']} ({r['input']}, {r['batch']} / {r['physical_batch']})"
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {ok} |")
    if cuda:
        lines += ["", "Ratios are DP step / non-private step; in brackets the peak GPU memory."]
    profiled = [r for r in report["results"] if "profile" in r["modes"]["nonprivate"]]
    if profiled:
        what = profiled[0]["modes"]["nonprivate"]["profile"]["what"]
        lines += ["", f"One profiled step per mode ({what}: count, busy ms, µs each):", ""]
        lines += ["| model | " + " | ".join(modes) + " |", "|---|" + "---|" * len(modes)]
        for r in profiled:
            cells = [
                "{count} ({busy_ms:.1f} ms, {us_per_kernel:.0f} µs)".format(
                    **r["modes"][m]["profile"]
                )
                for m in modes
            ]
            lines.append(f"| {r['model']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS), choices=list(SETTINGS))
    ap.add_argument(
        "--modes",
        nargs="+",
        default=list(DEFAULT_MODES),
        choices=[*DP_MODES, BASELINES[1]],
    )
    ap.add_argument("--compile-mode", default=COMPILE["mode"], help="for the -compiled modes")
    ap.add_argument("--compile-backend", default=COMPILE["backend"])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument(
        "--settle",
        type=int,
        default=1,
        help="untimed steps of a mode just before each of its timed steps (0: none)",
    )
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--tf32", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--check", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--check-batch", type=int, default=8)
    ap.add_argument("--tol", type=float, default=1e-9)
    ap.add_argument("--tiny", action="store_true", help="small batches: a smoke run")
    ap.add_argument("--tiny-batch", type=int, default=8)
    ap.add_argument("--out", type=Path, help="write dp_modes.json and dp_modes.md here")
    ap.add_argument(
        "--profile",
        action="store_true",
        help="also one profiled step per mode: kernels launched and their time (issue 47)",
    )
    ap.add_argument(
        "--batch",
        nargs="*",
        default=[],
        metavar="MODEL=N",
        help="another logical batch for a model (e.g. gnresnet10=512)",
    )
    args = ap.parse_args(argv)
    try:
        args.batch = {k: int(v) for k, v in (b.split("=", 1) for b in args.batch)}
    except ValueError:
        ap.error(f"--batch takes MODEL=N: {args.batch}")
    torch.set_num_threads(args.threads)
    COMPILE.update(mode=args.compile_mode, backend=args.compile_backend)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = args.tf32
        torch.backends.cudnn.allow_tf32 = args.tf32
        torch.backends.cudnn.benchmark = True
    report = {
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or platform.machine(),
        "host": platform.node(),
        "torch": torch.__version__,
        "opacus": opacus.__version__,
        "threads": torch.get_num_threads(),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "results": [],
    }

    def save() -> str:  # after every model: a run cut at a deadline keeps the finished ones
        md = markdown(report)
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "dp_modes.json").write_text(json.dumps(report, indent=2) + "\n")
            (args.out / "dp_modes.md").write_text(md)
        return md

    for name in args.models:
        res = bench_model(name, args, device)
        report["results"].append(res)
        print(json.dumps(res), flush=True)
        save()
    report["done"] = True
    print(save())
    failed = [r["model"] for r in report["results"] if not r.get("check", {"ok": True})["ok"]]
    if failed:
        print(f"clipped-sum check FAILED for {failed}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
