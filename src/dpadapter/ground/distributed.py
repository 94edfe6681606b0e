"""One DP job in several processes (torchrun): who this process is, the one sum, its shard.

A job whose config asks for `finetune.processes: k > 1` re-launches itself under torchrun
(`torchrun_command`); each of the k processes joins the process group torchrun describes in its
environment (`init`: NCCL on GPUs, gloo on the CPU) and trains one replica of the model on its
own shard of the private data. What keeps the guarantee that of a one-process run:

- **Sampling.** Rank r holds the rows r, r + k, r + 2k, ... (`shard`) and samples them Poisson at
  the configured q, from its own generator. Every example sits on exactly one rank, so each step
  includes each example independently with probability q, once: the union of the local batches
  is a Poisson batch of the whole set. Every rank takes the same number of steps per epoch
  (1/q, whatever its shard's size), so an empty local batch still joins the step's sum.
- **One sum, noise once.** The DP optimizer's noise phase (`per_sample.optimizers.DistributedNoise`)
  adds the Gaussian noise on rank 0 only and then sums the (noised there, plain elsewhere) clipped
  sums over the ranks in one all-reduce: every rank holds the same released vector, the global
  clipped sum plus one draw of N(0, sigma^2 C^2), before it is scaled by the global expected batch
  size and before the step hook. So everything after the release (the ledger, DP-SAT's previous
  noisy gradient, DP-SAM's ascent direction, the update, momentum) is computed from the same
  values on every rank, and the replicas stay equal without broadcasting weights.
- **Accounting.** Every rank records the same releases at the same (q, sigma), so the ledger's
  epsilon is a one-process run's.

Hand-written because Opacus' `DistributedDPOptimizer` all-reduces after the step hook (so a hook
would read a rank's own sum) and wraps only Opacus' own classes, while the pipeline's clip is
chosen per per-sample mode (bk) and its algorithms read the release in the hook.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset

# How long a collective waits for a rank before the job fails (a rank that died is noticed by
# torchrun within seconds; this bounds a rank that hangs).
TIMEOUT = timedelta(minutes=int(os.environ.get("DPADAPTER_DIST_TIMEOUT_MIN", "30")))
# torchrun's rendezvous options: one node by default; several nodes via this variable
# (docs/cluster.md, "One job on several GPUs").
RDZV_ENV = "DPADAPTER_TORCHRUN_ARGS"


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @property
    def writer(self) -> bool:
        """The one process that writes metrics.json, checkpoints, resume states and MLflow."""
        return self.rank == 0

    @property
    def multi(self) -> bool:
        return self.size > 1


def world() -> World:
    """This process's place in the job (one process: rank 0 of 1)."""
    if dist.is_available() and dist.is_initialized():
        return World(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0)))
    return World()


def launched() -> bool:
    """Whether torchrun started this process as one of several."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def init(device: torch.device) -> World:
    """Join the job's process group (env://, as torchrun sets it); a no-op for one process."""
    if not launched() or dist.is_initialized():
        return world()
    if device.type == "cuda":
        local, seen = int(os.environ.get("LOCAL_RANK", 0)), torch.cuda.device_count()
        if local >= seen:
            raise RuntimeError(
                f"process {local} of a job of {os.environ.get('LOCAL_WORLD_SIZE', '?')} per node "
                f"needs its own GPU and this node shows {seen} (CUDA_VISIBLE_DEVICES="
                f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}): lower finetune.processes / "
                "pretrain.processes or ask for as many GPUs (docs/cluster.md)"
            )
        torch.cuda.set_device(local)
    dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo", timeout=TIMEOUT)
    return world()


def shutdown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def torchrun_command(processes: int, argv: list[str]) -> list[str]:
    """This job's command line again, as `processes` processes under torchrun (one node unless
    $DPADAPTER_TORCHRUN_ARGS gives the rendezvous of several)."""
    rdzv = os.environ.get(RDZV_ENV, "--standalone").split()
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *rdzv,
        f"--nproc-per-node={processes}",
        "--max-restarts=0",
        "-m",
        "dpadapter",
        *argv,
    ]


def run_torchrun(processes: int, argv: list[str]) -> int:
    """Run the job under torchrun and return its status; SIGTERM, SIGINT and SIGHUP go on to
    torchrun, which stops every rank. A child process, not `exec`: the process that launched
    the job (the fork server's child, `dpadapter.launch.supervise`'s) reports the status itself."""
    import signal
    import subprocess

    sys.stdout.flush()
    sys.stderr.flush()
    proc = subprocess.Popen(torchrun_command(processes, argv))

    def forward(signum, _frame) -> None:
        proc.send_signal(signum)

    before = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    try:
        return proc.wait()
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


def all_reduce_sum(tensors: list[torch.Tensor]) -> None:
    """In place, every rank ends with the element-wise sum over the ranks (one collective)."""
    if not world().multi or not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset : offset + n].view_as(t))
        offset += n


def gather(obj: object) -> list[object]:
    """Every rank's `obj`, in rank order, on every rank (one process: `[obj]`)."""
    w = world()
    if not w.multi:
        return [obj]
    out: list[object] = [None] * w.size
    dist.all_gather_object(out, obj)
    return out


def shard(data: TensorDataset, w: World) -> TensorDataset:
    """Rank `w.rank`'s rows: r, r + k, r + 2k, ... (every row on exactly one rank)."""
    if not w.multi:
        return data
    return TensorDataset(*(t[w.rank :: w.size] for t in data.tensors))


def sample_seed(seed: int, w: World) -> int:
    """The seed of a rank's Poisson sampler: a one-process run's for rank 0, its own for others
    (ranks that drew the same masks would sample their shards alike, not independently)."""
    return 20_000 + seed + 1_000_003 * w.rank
