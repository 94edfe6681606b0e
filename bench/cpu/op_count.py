"""Ops one training step sends to torch's dispatcher, per mode and model: what a GPU launches.

At the sizes our users train (GNResNet-10 at 28x28, ResNet20-GN at 32x32, batches of a few
hundred) a GPU step is bound by kernel launches, not arithmetic: docs/gpu.md measured a bk step
at 3.39x a non-private one on an H200, where the CPU, which hides launches behind its slow
convolutions, shows 1.32-1.51x. This counts, without a GPU, roughly the kernels a step would
launch: every op that reaches the dispatcher below autograd (the forward's, the backward's and
the optimizer's, noise included) in one eager step, views, empty allocations and the
profiler's annotations left out (they launch nothing), grouped by op; and the bytes of the new
tensors the step's ops allocate (the temporaries, parameters' gradients included). Counted
with a `TorchDispatchMode`, after one untimed step of the same mode (lazy buffers, Opacus'
first-step set-up). The GPU side of the same question (the CUDA profiler's kernel count and time
per kernel) is `bench/cpu/dp_modes.py --profile` in step b of `bench/gpu/gpu_session.sh`.

    .venv/bin/python bench/cpu/op_count.py [--models gnresnet10 resnet20-gn] [--batch 64]
        [--modes nonprivate bk hooks ghost] [--top 12] [--out DIR] [--tiny] [--as-gpu]

The model and mode set-ups are `bench/cpu/dp_modes.py`'s (`Runner`), with noise on (σ = 1) so that
the noise draws are counted.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dp_modes import SETTINGS, Runner  # noqa: E402  (bench/ is not a package)

from dpadapter.models import create_model  # noqa: E402

MODES = ("nonprivate", "bk", "hooks", "ghost")
DEFAULT_MODELS = ("gnresnet10", "resnet20-gn")
# allocate without computing: no kernel on a GPU (the caching allocator hands memory out)
ALLOCATIONS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}
# the profiler's annotations (`record_function`, which `Optimizer.step` and `zero_grad` open
# on every call): dispatcher ops that launch nothing. Counted until 2026-11-28 (8923152), they
# added 6 to the non-private step and 2 to bk's, which flattered bk's ratio (1.59x, 1.65x
# without them, GNResNet-10)
ANNOTATIONS = {"_record_function_enter", "_record_function_enter_new", "_record_function_exit"}
# ops that make a GPU wait for the host to read a value (`.item()`, `float()`, `bool()` on a
# tensor dispatch to `_local_scalar_dense`) or whose output's size depends on the data: each is
# a host-device synchronisation inside the step (the CPU proxy of set_sync_debug_mode's count)
SYNCS = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2", "unique_dim"}


class OpCounter(TorchDispatchMode):
    """Counts the ops below autograd by name, views and bare allocations left out."""

    def __init__(self):
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.views: Counter[str] = Counter()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if func.is_view or name in ALLOCATIONS or name in ANNOTATIONS:
            self.views[name] += 1
            return out
        self.ops[name] += 1
        inputs = {id(t) for t in tree_leaves((args, kwargs)) if torch.is_tensor(t)}
        for t in tree_leaves(out):
            if torch.is_tensor(t) and id(t) not in inputs:  # in-place ops return an input
                self.bytes += t.untyped_storage().nbytes()
        return out


def count_step(runner: Runner, x: torch.Tensor, y: torch.Tensor) -> OpCounter:
    runner.step(x, y)  # untimed: lazy buffers and first-step set-up out of the count
    runner.release()
    with OpCounter() as counter:
        runner.step(x, y)
    runner.release()
    return counter


def count_model(name: str, modes: list[str], batch: int, tiny: bool, as_gpu: bool = False) -> dict:
    s = SETTINGS[name]
    if tiny:
        s = dataclasses.replace(s, model=dataclasses.replace(s.model, groups=4, width=8))
    torch.manual_seed(0)
    base = create_model(s.model, s.classes, s.shape[0], seed=0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, *s.shape, generator=g)
    y = torch.randint(0, s.classes, (batch,), generator=g)
    out: dict = {"model": name, "batch": batch, "input": "x".join(map(str, s.shape)), "modes": {}}
    for mode in modes:
        # as a GPU runs it: SGD's one `_foreach` update (its CUDA default) and bk's per-layer
        # choices for a device where launches dominate (`rules.Settings.launch_bound`)
        runner = Runner(mode, base, batch, batch, 1.0, foreach=True if as_gpu else None)
        if mode == "bk":
            runner.model.launch_bound = as_gpu
        if mode != "nonprivate":
            runner.opt.noise_multiplier = 1.0  # the noise draws and additions are counted
        c = count_step(runner, x, y)
        out["modes"][mode] = {
            "ops": sum(c.ops.values()),
            "host_syncs": sum(v for k, v in c.ops.items() if k in SYNCS),
            "views_and_allocations": sum(c.views.values()),
            "bytes_allocated": c.bytes,
            "by_op": dict(c.ops.most_common()),
        }
    base_ops = out["modes"].get("nonprivate", {}).get("ops")
    for m in out["modes"].values():
        m["ratio"] = round(m["ops"] / base_ops, 2) if base_ops else None
    return out


def markdown(report: dict, top: int) -> str:
    lines = [
        f"Dispatched ops of one eager training step ({report['device']}, torch "
        f"{report['torch']}; views, empty allocations and profiler annotations left out; "
        "bench/cpu/op_count.py"
        + (
            " --as-gpu: SGD's foreach update, bk's choices where launches dominate)"
            if report.get("as_gpu")
            else "; the CPU's optimizer loop and bk's CPU choices)"
        ),
        "",
        "| model | batch | mode | ops | × non-private | host syncs | MiB allocated | top ops |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in report["results"]:
        for mode, m in r["modes"].items():
            tops = ", ".join(f"{k} {v}" for k, v in list(m["by_op"].items())[:top])
            ratio = "" if m["ratio"] is None else f"{m['ratio']:.2f}"
            lines.append(
                f"| {r['model']} | {r['batch']} | {mode} | {m['ops']} | {ratio} | "
                f"{m['host_syncs']} | {m['bytes_allocated'] / 2**20:.1f} | {tops} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS), choices=list(SETTINGS))
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--tiny", action="store_true", help="narrow models and batch 8: a smoke run")
    ap.add_argument(
        "--as-gpu",
        action="store_true",
        help="count the step as a GPU runs it: SGD's foreach update, bk's GPU per-layer choices",
    )
    ap.add_argument("--out", type=Path, help="write op_count.json and op_count.md here")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    batch = 8 if args.tiny else args.batch
    report = {
        "device": "cpu",
        "host": platform.node(),
        "torch": torch.__version__,
        "as_gpu": args.as_gpu,
        "results": [count_model(m, args.modes, batch, args.tiny, args.as_gpu) for m in args.models],
    }
    md = markdown(report, args.top)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "op_count.json").write_text(json.dumps(report, indent=2) + "\n")
        (args.out / "op_count.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
