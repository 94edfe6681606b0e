"""Batches for DP training on any device: Poisson logical batches, fixed-shape physical batches.

The accountant assumes Poisson sampling, so logical batches come from Opacus'
`UniformWithReplacementSampler` (each example independently with probability q), and batches
larger than the physical limit are split by Opacus' `BatchSplittingSampler`, which tells the DP
optimizer to skip the update until the logical batch ends. Both are used as index samplers: the
rows are gathered from tensors that may already live on the GPU, so no DataLoader collates
examples one by one and no worker process starts per epoch. The index stream, and so every
batch, is exactly what Opacus' `DPDataLoader` (+ `BatchMemoryManager`) yields from the same
generator (tests/train/test_batching.py).

Why padding on CUDA. Poisson batch sizes vary from step to step; with `cudnn.benchmark` every
new shape triggers a new autotuning pass (measured: 7.7 s per step instead of 0.23 s). Padding
every physical batch to one size `pad_to` gives cuDNN a single shape. Padded rows carry the
label `PAD_LABEL`; `masked_cross_entropy` gives them zero loss and hence an exactly zero
per-sample gradient, which clipping keeps at zero, so the clipped sum, the noise and the update
are those of the unpadded batch (tests/train/test_batching.py). The division is by the padded
size because Opacus multiplies per-sample gradients by the physical batch size under
`loss_reduction="mean"`. Padding, not Opacus' BatchMemoryManager alone, because the manager
still emits a variable-size last chunk per logical batch. Algorithms that count examples
(AdpClip's unclipped count) read `valid_rows` from the optimizer, set for every physical batch.
Federated clients pad their Poisson samples with the same `pad_batch`.

A dataset too large for the GPU stays in pinned host memory (`dpadapter.ground.device.place`); its
batches are gathered into pinned buffers (`dpadapter.ground.device.gather`), since indexing pinned
memory yields pageable memory, whose copy to the GPU would block.

Opacus is imported by the DP batches only: the non-private loops (warm-up, pre-training) use
`ShuffledBatches` and never import it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch.utils.data import BatchSampler, RandomSampler, TensorDataset

from dpadapter.ground.device import gather
from dpadapter.privacy import randomness

PAD_LABEL = -100


def wants_padding(mode: bool | str, device: torch.device, compiled: bool = False) -> bool:
    """`pad_batches`: true, false, or "auto": on CUDA, where cuDNN tunes per shape, and for a
    compiled step (`finetune.compile`), which is compiled once per shape."""
    return mode is True or (mode == "auto" and (device.type == "cuda" or compiled))


def pad_batch(
    x: torch.Tensor, y: torch.Tensor, size: int, optimizer=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch grown to `size` rows of zeros labelled PAD_LABEL (a larger one is left as is).

    `optimizer` (optional) learns which rows are examples (`valid_rows`, for counts).
    """
    extra = size - len(y)
    if extra > 0:
        x = torch.cat([x, x.new_zeros((extra, *x.shape[1:]))])
        y = torch.cat([y, y.new_full((extra,), PAD_LABEL)])
    if optimizer is not None:
        optimizer.valid_rows = y != PAD_LABEL
    return x, y


def masked_cross_entropy(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the physical batch in which padded rows contribute zero."""
    return F.cross_entropy(logits, y, ignore_index=PAD_LABEL, reduction="sum") / y.shape[0]


def padded_size(expected: float, sample_rate: float, multiple: int = 8) -> int:
    """A physical size that a Poisson batch exceeds with probability ~3e-5 (mean + 4 std).

    A larger batch is split into two padded physical batches (a virtual step), so the shape
    stays fixed either way; this only sets how rarely that happens.
    """
    std = math.sqrt(max(expected * (1 - sample_rate), 0.0))
    return int(math.ceil((expected + 4 * std + 1) / multiple) * multiple)


class PoissonBatches:
    """Physical batches (x, y) of Poisson-sampled logical batches, on `device`.

    `max_physical`: split logical batches into physical ones of at most this many rows (needs
    the DP optimizer to signal skipped steps). `pad`: pad every physical batch to exactly
    `max_physical` rows with label PAD_LABEL. Neither: one physical batch per logical batch,
    as Opacus' DPDataLoader yields it.
    """

    def __init__(
        self,
        data: TensorDataset,
        sample_rate: float,
        generator: torch.Generator,
        device: torch.device,
        max_physical: int | None = None,
        pad: bool = False,
        optimizer=None,
    ):
        if pad and max_physical is None:
            raise ValueError("padding needs a physical batch size")
        if max_physical is not None and optimizer is None:
            raise ValueError("splitting logical batches needs the DP optimizer")
        from opacus.utils.batch_memory_manager import BatchSplittingSampler
        from opacus.utils.uniform_sampler import UniformWithReplacementSampler

        self.x, self.y = data.tensors
        self.device = device
        self.pad = pad
        self.max_physical = max_physical
        if randomness.is_secret(generator):
            poisson = _secret_poisson_sampler()
        else:
            poisson = UniformWithReplacementSampler
        self.poisson = poisson(
            num_samples=len(self.y), sample_rate=sample_rate, generator=generator
        )
        self.indices = (
            self.poisson
            if max_physical is None
            else BatchSplittingSampler(
                sampler=self.poisson, max_batch_size=max_physical, optimizer=optimizer
            )
        )
        self.optimizer = optimizer

    def __len__(self) -> int:
        """Logical batches (= releases) per epoch."""
        return len(self.poisson)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        # A DataLoader's iterator draws its workers' base seed from the same generator when it
        # is made, not at its first batch; drawing it the same way keeps the batches of
        # DPDataLoader's runs, also where an iterator is made and dropped (tqdm.auto's
        # `tqdm_asyncio` makes one in its constructor, then iterates afresh: two draws per
        # epoch on both paths; tests/train/test_batching.py).
        torch.empty((), dtype=torch.int64).random_(generator=self.poisson.generator)
        return self._batches()

    def _batches(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for idx in self.indices:
            rows = torch.as_tensor(idx, dtype=torch.long)
            x, y = gather(self.x, rows, self.device), gather(self.y, rows, self.device)
            if self.pad:
                assert self.max_physical is not None
                x, y = pad_batch(x, y, self.max_physical, self.optimizer)
            yield x, y


class ShuffledBatches:
    """Mini-batches of a reshuffled pass without replacement, gathered on `device`.

    The same batches as `DataLoader(data, batch_size, shuffle=True, generator=g)`: the same
    samplers (RandomSampler, BatchSampler) and, like the DataLoader's iterator, one int64 drawn
    from `g` before the permutation (the loader's worker base seed), so runs from before this
    class existed are reproduced exactly on the CPU.
    """

    def __init__(
        self, data: TensorDataset, batch_size: int, generator: torch.Generator, device=None
    ):
        self.x, self.y = data.tensors
        self.generator = generator
        self.device = device if device is not None else self.x.device
        self.sampler = BatchSampler(
            RandomSampler(range(len(self.y)), generator=generator), batch_size, drop_last=False
        )

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        torch.empty((), dtype=torch.int64).random_(generator=self.generator)
        for idx in self.sampler:
            rows = torch.as_tensor(idx, dtype=torch.long)
            yield gather(self.x, rows, self.device), gather(self.y, rows, self.device)


def _secret_poisson_sampler():
    from opacus.utils.uniform_sampler import UniformWithReplacementSampler

    class SecretPoissonSampler(UniformWithReplacementSampler):
        """Opacus' Poisson sampler with each step's mask from the OS (privacy.randomness)."""

        def __iter__(self):
            for _ in range(self.steps):
                mask = randomness.poisson_mask(self.num_samples, self.sample_rate, self.generator)
                yield mask.nonzero(as_tuple=False).reshape(-1).tolist()

    return SecretPoissonSampler


def dp_batches(data: TensorDataset, sample_rate: float, generator, device, **split):
    """The DP loop's batches: on the CPU without padding, Opacus' own DPDataLoader (split into
    physical batches by Opacus' `wrap_data_loader`, what BatchMemoryManager does), exactly the
    loader runs made before GPU support used, so they reproduce bit for bit; otherwise
    `PoissonBatches` (the same index stream, gathered on the device, padded when asked).
    `split` are PoissonBatches' `max_physical`, `pad` and `optimizer`."""
    cpu = device.type == "cpu" and data.tensors[0].device.type == "cpu"
    # secret randomness: PoissonBatches, whose masks come from the OS (Opacus' loader would
    # draw them from the generator)
    if not split.get("pad") and cpu and not randomness.is_secret(generator):
        from opacus.data_loader import DPDataLoader
        from opacus.utils.batch_memory_manager import wrap_data_loader

        loader = DPDataLoader(data, sample_rate=sample_rate, generator=generator)
        if split.get("max_physical") is None:
            return loader
        physical = wrap_data_loader(
            data_loader=loader, max_batch_size=split["max_physical"], optimizer=split["optimizer"]
        )
        physical.logical_batches = len(loader)  # len(physical) counts physical batches
        return physical
    return PoissonBatches(data, sample_rate, generator, device, **split)
