"""Time per DP step of one job in k processes (issue 39): k = 1 against k = 2, ..., and the
all-reduce's share of a step.

    python bench/cpu/ddp_step.py --procs 1 2 --model resnet20-gn --batch 256 --steps 10
    python bench/cpu/ddp_step.py --procs 1 2 4 --device cuda ...   # the same on a multi-GPU node

For each k it runs itself under torchrun with k processes (gloo on the CPU, NCCL on GPUs). Every
process builds the same model and the pipeline's DP optimizer (per-sample mode `bk` by default,
`per_sample.optimizers.dp_optimizer`, so a job of several processes gets `DistributedNoise`),
takes its 1/k of one fixed global batch and times whole steps (forward, backward, clip, the
one all-reduce of the noised clipped sums, update) with a barrier around each, and the
all-reduce alone (`distributed.all_reduce_sum`, wrapped with a timer). Medians over `--steps`
after `--warmup` steps. On the CPU the machine's threads are shared: each of k processes gets
threads // k of them (`--threads`), so the figures compare using the same cores differently.

Writes `<out>/ddp_step.json` and `<out>/ddp_step.md`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "src"))

SHAPES = {"resnet20-gn": (3, 32, 32), "cnn-gn": (1, 28, 28), "gnresnet10": (1, 28, 28)}


def worker(args: argparse.Namespace) -> None:
    import torch
    from opacus.optimizers import DPOptimizer
    from torch import nn

    from dpadapter.ground import distributed
    from dpadapter.models import create_model
    from dpadapter.per_sample import wrap_for_dp
    from dpadapter.per_sample.optimizers import dp_optimizer
    from dpadapter.settings import ModelConfig

    dev = torch.device(args.device)
    w = distributed.init(dev)
    if dev.type == "cuda":
        dev = torch.device("cuda", torch.cuda.current_device())
    torch.set_num_threads(max(1, args.threads // w.size))
    shape = SHAPES[args.model]
    torch.manual_seed(0)
    model = create_model(ModelConfig(name=args.model), 10, shape[0], seed=0).to(dev)
    wrapped = wrap_for_dp(model, args.mode, False, (shape, torch.float32), check=False)
    opt = dp_optimizer(
        DPOptimizer, wrapped, torch.optim.SGD(wrapped.parameters(), lr=0.01),
        noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=args.batch,
        generator=torch.Generator(device=dev).manual_seed(0),
    )  # fmt: skip
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, *shape, generator=g)[w.rank :: w.size].to(dev)
    y = torch.randint(0, 10, (args.batch,), generator=g)[w.rank :: w.size].to(dev)
    reduce_s: list[float] = []
    real = distributed.all_reduce_sum

    def timed(tensors):
        sync(dev)
        t0 = time.perf_counter()
        real(tensors)
        sync(dev)
        reduce_s.append(time.perf_counter() - t0)

    distributed.all_reduce_sum = timed
    step_s = []
    for i in range(args.warmup + args.steps):
        barrier(w)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(wrapped(x), y).backward()
        opt.step()
        sync(dev)
        barrier(w)
        if i >= args.warmup:
            step_s.append(time.perf_counter() - t0)
    reduce_s = reduce_s[args.warmup :] if w.multi else [0.0] * len(step_s)
    if w.writer:
        n_params = sum(p.numel() for p in model.parameters())
        out = {
            "processes": w.size,
            "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
            "threads_per_process": torch.get_num_threads(),
            "step_ms": 1e3 * statistics.median(step_s),
            "allreduce_ms": 1e3 * statistics.median(reduce_s),
            "params": n_params,
        }
        Path(args.result).write_text(json.dumps(out))
    distributed.shutdown()


def sync(dev) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def barrier(w) -> None:
    import torch.distributed as dist

    if w.multi:
        dist.barrier()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--procs", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--model", default="resnet20-gn", choices=sorted(SHAPES))
    ap.add_argument("--mode", default="bk")
    ap.add_argument("--batch", type=int, default=256, help="global batch of one step")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--out", type=Path, default=REPO / "results/bench/ddp_step")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for k in args.procs:
        result = args.out / f"k{k}.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={k}", "--max-restarts=0", __file__, "--worker",
               "--result", str(result), *sys.argv[1:]]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
        subprocess.run(cmd, check=True, env=env)
        rows.append(json.loads(result.read_text()))
    base = rows[0]["step_ms"]
    lines = [
        f"{args.model}, global batch {args.batch}, mode {args.mode}, device {rows[0]['device']}, "
        f"median of {args.steps} steps after {args.warmup}",
        "",
        "| processes | threads each | ms / DP step | vs first | all-reduce ms | all-reduce share |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        share = r["allreduce_ms"] / r["step_ms"]
        lines.append(
            f"| {r['processes']} | {r['threads_per_process']} | {r['step_ms']:.1f} | "
            f"{r['step_ms'] / base:.2f}x | {r['allreduce_ms']:.2f} | {100 * share:.1f} % |"
        )
    (args.out / "ddp_step.json").write_text(json.dumps({"args": vars(args), "rows": rows},
                                                       default=str, indent=2))  # fmt: skip
    (args.out / "ddp_step.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
