"""The one place that decides where tensors live and how CUDA is configured.

Every stage asks `resolve(cfg)` for its device instead of testing `torch.cuda.is_available()`
itself, so `device: cpu` in the config (or `DPADAPTER_DEVICE=cpu` for a single job) really keeps
a job off the GPU, and a job that was asked for CUDA on a node without one fails at once instead
of silently running on the node's CPUs for hours.

Random streams that must stay reproducible across devices (data order, Poisson sampling, weight
noise of the robustness metric) use CPU generators; the Gaussian noise of the DP mechanism is
drawn on the parameters' device from a seeded generator of that device, because Opacus draws it
with `torch.normal(..., generator=g, device=p.device)` and cannot mix a CPU generator with CUDA
tensors.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import TensorDataset

ENV_VAR = "DPADAPTER_DEVICE"
CHOICES = ("auto", "cpu", "cuda")

# Datasets up to this share of the free GPU memory are copied to the GPU once; larger ones stay
# in pinned host memory and move batch by batch.
_RESIDENT_SHARE = 0.25


class DeviceError(RuntimeError):
    """The requested device cannot be used here."""


def requested(configured: str = "auto") -> str:
    """The device asked for: the environment variable wins over the config (one job, one node)."""
    choice = os.environ.get(ENV_VAR, "").strip().lower() or configured
    base = choice.split(":", 1)[0]
    if base not in CHOICES:
        raise DeviceError(f"device {choice!r} (from ${ENV_VAR} or config): use one of {CHOICES}")
    return choice


def resolve(configured: str = "auto") -> torch.device:
    choice = requested(configured)
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if choice.startswith("cuda") and not torch.cuda.is_available():
        raise DeviceError(
            f"device {choice!r} requested but torch {torch.__version__} sees no CUDA device "
            f"(CUDA build: {torch.version.cuda}); set device: auto or cpu, or run on a GPU node"
        )
    return torch.device(choice)


def configure(device: torch.device, tf32: bool = True) -> None:
    """TF32 matmuls/convolutions (free speed on Ampere+), cuDNN autotuning for fixed shapes.

    cuDNN benchmark mode re-tunes for every new input shape; the DP loops therefore pad Poisson
    batches to one fixed physical size on CUDA (`dpadapter.train.batching`).
    """
    if device.type != "cuda":
        return
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    torch.backends.cudnn.benchmark = True


@contextmanager
def full_fp32() -> Iterator[None]:
    """Full-FP32 matmuls and convolutions inside (no TF32), the previous settings restored after.

    DP clipping takes each example's gradient norm with one kernel and the clipped sum with
    another; TF32 rounds the inputs of the second to a 10-bit mantissa, so a clipped example
    could add up to ~1e-3 (relative) more than C to the sum, past the sensitivity the
    accountant assumes. In FP32 both agree to FP32 rounding, as they do on the CPU. The flags
    are process-wide, so they are restored whatever happens inside (an exception too). Only
    the per-backend flags that `configure` sets are read and written: torch >= 2.9 refuses the
    backend-less `get_float32_matmul_precision()` once a backend's flag differs from the others'
    (seen on CUDA with torch 2.11 after `configure`), which would stop every DP job.
    """
    matmul = torch.backends.cuda.matmul.allow_tf32
    conv = torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = matmul
        torch.backends.cudnn.allow_tf32 = conv


@contextmanager
def deterministic_kernels() -> Iterator[None]:
    """cuDNN's deterministic algorithms inside, the previous settings restored after.

    A check that compares two runs of one shape bit for bit needs kernels whose sums keep one
    order: cuDNN's fastest weight-gradient convolutions add with atomics, so two backward passes
    of the same batch differ in the last bits (on the first H200, 2026-11-28, the independence
    check refused GNResNet-10 for that alone). Autotuning is off inside, so the algorithm does
    not depend on a timing either. The flags are process-wide and restored whatever happens.
    """
    deterministic = torch.backends.cudnn.deterministic
    benchmark = torch.backends.cudnn.benchmark
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    try:
        yield
    finally:
        torch.backends.cudnn.deterministic = deterministic
        torch.backends.cudnn.benchmark = benchmark


def describe(device: torch.device) -> dict[str, Any]:
    """What metrics.json and MLflow record about where a job ran."""
    out: dict[str, Any] = {
        "device": str(device),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "host": platform.node(),
    }
    if device.type == "cuda":
        idx = device.index if device.index is not None else torch.cuda.current_device()
        out["device_name"] = torch.cuda.get_device_name(idx)
        out["cudnn"] = torch.backends.cudnn.version()
        out["tf32"] = bool(torch.backends.cuda.matmul.allow_tf32)
    else:
        out["device_name"] = platform.processor() or platform.machine()
    return out


def generator(device: torch.device, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def rng_state(device: torch.device) -> dict[str, Any]:
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def place(data: TensorDataset, device: torch.device) -> TensorDataset:
    """The dataset on the GPU when it fits comfortably, else in pinned host memory; CPU: as is."""
    if device.type != "cuda":
        return data
    nbytes = sum(t.numel() * t.element_size() for t in data.tensors)
    free, _ = torch.cuda.mem_get_info(device)
    if nbytes <= _RESIDENT_SHARE * free:
        return TensorDataset(*(t.to(device) for t in data.tensors))
    return TensorDataset(*(t.pin_memory() for t in data.tensors))


def onto(
    t: torch.Tensor | None, device: torch.device | None, dtype: torch.dtype | None = None
) -> torch.Tensor | None:
    """A restored state tensor where the parameters are: resume states are read onto the CPU
    (a CUDA node may write what another node, or the CPU, reads), and a CPU tensor kept next to
    CUDA weights fails at the next step. Floating tensors also take the parameters' dtype (they
    mirror a parameter or an input of the model); integer ones (labels, indices) keep theirs.
    None (no tensor, or no device/dtype given) leaves things as they are."""
    if t is None:
        return None
    return t.to(device=device, dtype=dtype if t.is_floating_point() else None)


@dataclass(frozen=True)
class Place:
    """Where restored state tensors go (`onto`): the parameters' device and dtype."""

    device: torch.device | None = None
    dtype: torch.dtype | None = None

    def __call__(self, t: torch.Tensor | None) -> torch.Tensor | None:
        return onto(t, self.device, self.dtype)

    def all(self, ts: list[torch.Tensor | None] | None) -> list[torch.Tensor | None] | None:
        """Each tensor of a list placed; None (no list saved) stays None."""
        return None if ts is None else [self(t) for t in ts]


def to(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host-to-device copy that overlaps compute when the source is pinned."""
    return x.to(device, non_blocking=x.is_pinned())


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_mib(device: torch.device) -> float | None:
    """Largest GPU memory the job's tensors held (PyTorch's allocator), in MiB; None off CUDA.

    Recorded per job so that a cell's memory stands beside its accuracy and wall time (the
    allocator's own figure: the CUDA context and cached free blocks are not counted)."""
    if device.type != "cuda":
        return None
    return round(torch.cuda.max_memory_allocated(device) / 2**20, 1)


def gather(src: torch.Tensor, rows: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`src[rows]` on `device`, for batches drawn from a dataset that `place` left on the host.

    Indexing pinned memory returns pageable memory, whose copy to the GPU blocks; so rows of a
    pinned source are gathered into a fresh pinned buffer and copied asynchronously. PyTorch's
    pinned-memory allocator caches those buffers and does not hand one out again before its
    copy has finished, so a buffer per batch is cheap and safe.
    """
    if src.device.type != "cpu":
        return to(src[rows.to(src.device)], device)
    if not _is_pinned(src):
        return to(src[rows], device)
    buf = _pinned_empty((len(rows), *src.shape[1:]), src.dtype)
    torch.index_select(src, 0, rows, out=buf)
    return buf.to(device, non_blocking=True)


def _is_pinned(t: torch.Tensor) -> bool:
    return t.is_pinned()


def _pinned_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, pin_memory=True)
