"""Dataset registry: a name maps to a loader returning whole train and test splits as tensors.

Everything downstream (task carving, normalisation, loaders) works on uint8 image tensors, so a
new dataset is one small function registered here.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch


class DatasetUnavailable(FileNotFoundError):
    """The files of a dataset are missing and cannot be downloaded; the message names them."""


@dataclass(frozen=True)
class ArraySplit:
    images: torch.Tensor  # uint8, (N, C, H, W)
    labels: torch.Tensor  # int64, (N,)

    def __post_init__(self) -> None:
        if self.images.ndim != 4 or self.images.shape[0] != self.labels.shape[0]:
            raise ValueError(
                f"bad split shapes {tuple(self.images.shape)} / {tuple(self.labels.shape)}"
            )

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def subset(self, idx: torch.Tensor) -> ArraySplit:
        return ArraySplit(self.images[idx], self.labels[idx])


Loader = Callable[[Path, bool], tuple[ArraySplit, ArraySplit]]
DATASETS: dict[str, Loader] = {}


def register_dataset(name: str) -> Callable[[Loader], Loader]:
    def deco(fn: Loader) -> Loader:
        if name in DATASETS:
            raise KeyError(f"dataset {name!r} registered twice")
        DATASETS[name] = fn
        return fn

    return deco


def load_dataset(
    name: str, root: str | Path, download: bool = False
) -> tuple[ArraySplit, ArraySplit]:
    try:
        loader = DATASETS[name]
    except KeyError:
        raise KeyError(f"unknown dataset {name!r}; known: {sorted(DATASETS)}") from None
    cache = Path(root) / ".cache" / f"{name}.pt"
    if cache.is_file():
        d = torch.load(cache, weights_only=True)
        return ArraySplit(*d["train"]), ArraySplit(*d["test"])
    train, test = loader(Path(root), download)
    # Decoding idx/pickle/mat files costs a second or more in every job; a tensor file is ~10x
    # faster. Delete data/.cache to rebuild it after changing the source files.
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(f".{os.getpid()}.tmp")
    torch.save({"train": (train.images, train.labels), "test": (test.images, test.labels)}, tmp)
    os.replace(tmp, cache)
    return train, test
