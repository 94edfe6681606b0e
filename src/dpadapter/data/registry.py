"""Dataset registry: a name maps to a loader returning whole train and test splits as tensors.

Everything downstream (task carving, normalisation, loaders) works on uint8 image tensors, so a
new dataset is one small function registered here.

A family of datasets named `<prefix>:<spec>` (`imagefolder:<path>@<side>`, a user's folder)
cannot list its class counts statically: `register_family` gives a resolver that reads them
from `data.root` when a config is validated or a dataset loaded (`resolve_dataset`), and
(re)registers the name from that reading.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

# torch is imported where tensors are loaded: the names, counts and file checks are read while
# the workflow parses, which imports no torch.
if TYPE_CHECKING:
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


# A loader's splits, in this order
SPLITS = ("train", "test", "val")
# (train, test), or (train, test, val) for a source with a validation split of its own
# (`DatasetInfo.val_counts`)
Loader = Callable[[Path, bool], tuple[ArraySplit, ...]]
DATASETS: dict[str, Loader] = {}


@dataclass(frozen=True)
class DatasetInfo:
    """What the config validation needs to know of a dataset without loading it.

    `train_counts[c]` / `test_counts[c]` are the examples of class c in the source's train and
    test splits (so class ids, split sizes and delta <= 1/n are checked before any job);
    `missing(root, download)` is a cheap look for the files, returning the loader's own
    "not available offline" message, or None when the loader will find (or fetch) them.
    `sources(root)` lists what the loader reads (see the field). `val_counts`, for a source
    with a validation split of its own (an image folder's val/), are its examples by class: the
    loader then returns (train, test, val), and every role draws its validation examples from
    that split, never from train (`dpadapter.data.tasks`).
    """

    train_counts: tuple[int, ...]
    test_counts: tuple[int, ...]
    missing: Callable[[Path, bool], str | None] = lambda root, download: None
    channels: int | None = None  # of its images (None: not known before loading)
    # the files and folders (under data.root) the loader reads, whose sizes and mtimes key its
    # tensor cache (`tensor_cache`); None: never cached (made by code, as fast as a cache read)
    sources: Callable[[Path], list[Path]] | None = None
    # the content fingerprint of what the loader reads (`data_fingerprint`), for the workflow's
    # rerun triggers; None: the files named by `sources` are hashed
    fingerprint: Callable[[Path], str | None] | None = None
    val_counts: tuple[int, ...] | None = None

    @property
    def num_classes(self) -> int:
        return len(self.train_counts)


DATASET_INFO: dict[str, DatasetInfo] = {}


def register_dataset(name: str, info: DatasetInfo) -> Callable[[Loader], Loader]:
    def deco(fn: Loader) -> Loader:
        if name in DATASETS:
            raise KeyError(f"dataset {name!r} registered twice")
        DATASETS[name] = fn
        DATASET_INFO[name] = info
        return fn

    return deco


Resolver = Callable[[str, Path], tuple[Loader, DatasetInfo]]
FAMILIES: dict[str, Resolver] = {}


def register_family(prefix: str, resolver: Resolver) -> Resolver:
    """`resolver(spec, root)` -> (loader, info) for the name `prefix:spec`; it raises
    DatasetUnavailable (or ValueError for a malformed spec) with a message naming the path."""
    if prefix in FAMILIES:
        raise KeyError(f"dataset family {prefix!r} registered twice")
    FAMILIES[prefix] = resolver
    return resolver


# family name -> the data root it was read under (validation, the file check and the loader of
# one process share one reading)
_RESOLVED: dict[str, Path] = {}


def family_of(name: str) -> str | None:
    prefix, sep, _ = name.partition(":")
    return prefix if sep and prefix in FAMILIES else None


def resolve_dataset(
    name: str, root: str | Path, missing_ok: bool = False, fresh: bool = False
) -> str | None:
    """For a family name, (re)register it as found under `root`; return why it cannot be, or
    None (also for a plain name, whose entry is static). `missing_ok`: data that is not there
    (yet) is no problem, the name stays unregistered (a config check without file checks).
    Without `fresh`, a reading under the same root earlier in this process is reused (the
    file check and the loader right after validation; listing ImageNet costs seconds)."""
    family = family_of(name)
    if family is None:
        return None
    where = Path(root).resolve()
    if not fresh and _RESOLVED.get(name) == where and name in DATASET_INFO:
        return None
    DATASETS.pop(name, None)  # a reading under another root must not linger
    DATASET_INFO.pop(name, None)
    _RESOLVED.pop(name, None)
    try:
        loader, info = FAMILIES[family](name.partition(":")[2], Path(root))
    except DatasetUnavailable as exc:
        return None if missing_ok else str(exc)
    except ValueError as exc:
        return str(exc)
    DATASETS[name] = loader
    DATASET_INFO[name] = info
    _RESOLVED[name] = where
    return None


def cache_path(name: str, root: str | Path) -> Path:
    # a family name holds a path: keep the cache one flat file (plain names are unchanged)
    return Path(root) / ".cache" / f"{re.sub(r'[^A-Za-z0-9._-]', '_', name)}.pt"


def missing_files(name: str, root: str | Path, download: bool) -> str | None:
    """None if `load_dataset(name, root, download)` will find its data, else why it will not."""
    problem = resolve_dataset(name, root)
    if problem is not None:
        return problem
    if name not in DATASET_INFO:
        return f"unknown dataset {name!r}; known: {sorted(DATASETS)}"
    return DATASET_INFO[name].missing(Path(root), download)


def data_fingerprint(name: str, root: str | Path) -> str | None:
    """A hash of the content the loader of `name` reads (not of paths or mtimes), so a job's
    rerun trigger changes exactly when its data does; None for data made by code (nothing to
    change) or files not fetched yet. Hashes are remembered by path, size and mtime
    (`dpadapter.data.manifest`): only a new or changed file is read."""
    from dpadapter.data.manifest import file_fingerprint

    if resolve_dataset(name, root) is not None or name not in DATASET_INFO:
        return None
    info, root = DATASET_INFO[name], Path(root)
    if info.fingerprint is not None:
        return info.fingerprint(root)
    if info.sources is None:
        return None
    files = {
        str(p.relative_to(root)) if p.is_relative_to(root) else p.name: p
        for p in info.sources(root)
    }
    return file_fingerprint(files, root / ".cache" / "manifests")


def load_dataset(name: str, root: str | Path, download: bool = False) -> tuple[ArraySplit, ...]:
    """The splits of `name` ((train, test), or (train, test, val) with `val_counts`), from its
    tensor cache under `<root>/.cache/` while that is sound for the current source files
    (`tensor_cache`), else decoded by its loader and cached."""
    problem = resolve_dataset(name, root)
    if problem is not None:
        raise DatasetUnavailable(problem)
    try:
        loader = DATASETS[name]
    except KeyError:
        raise KeyError(f"unknown dataset {name!r}; known: {sorted(DATASETS)}") from None
    root = Path(root)
    sources = DATASET_INFO[name].sources
    if sources is None:
        return loader(root, download)

    from dpadapter.data import tensor_cache  # torch: not while the workflow parses

    def build():
        return tuple((s.images, s.labels) for s in loader(root, download))

    splits = tensor_cache.load_or_build(
        cache_path(name, root), name, root, lambda: sources(root), build
    )
    return tuple(ArraySplit(*s) for s in splits)
