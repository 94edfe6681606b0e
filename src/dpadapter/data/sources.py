"""Real dataset loaders, all through torchvision, plus a synthetic set the tests make.

Fashion-MNIST is read from Debian's `dataset-fashion-mnist` files when present (the embedded
default runs offline); CIFAR-10/100, SVHN and STL-10 are downloaded by torchvision where the
cluster has internet, otherwise the error names the files to place under `data.root`.
Each registration lists the files its loader reads (`sources`): `load_dataset` decodes them
once into a tensor cache keyed by their sizes and mtimes (`tensor_cache`), so torchvision is
imported only by the job that builds it.
"""

from __future__ import annotations

import gzip
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from dpadapter.compat.torchvision_ops import import_torchvision
from dpadapter.data.registry import ArraySplit, DatasetInfo, DatasetUnavailable, register_dataset

# numpy and torch are imported inside the loaders: registering (names, class counts, file
# checks) happens while the workflow parses, which imports neither.
if TYPE_CHECKING:
    import numpy as np
    import torch

DEBIAN_FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")
# A folder holding the four .gz files where Debian's package is absent (a GPU image without
# apt, a cluster node): the GPU scripts carry the data there (bench/gpu/gpu_env.sh).
FMNIST_ENV = "FMNIST_DIR"


def fashion_mnist_source() -> Path:
    """Where the .gz files are read from: $FMNIST_DIR when set, else Debian's folder."""
    return Path(os.environ.get(FMNIST_ENV) or DEBIAN_FASHION_MNIST)


_FMNIST_FILES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)


def _as_split(images: np.ndarray | torch.Tensor, labels, channels_last: bool) -> ArraySplit:
    import numpy as np
    import torch

    x = torch.as_tensor(np.asarray(images))
    if x.ndim == 3:
        x = x.unsqueeze(1)
    elif channels_last:
        x = x.permute(0, 3, 1, 2)
    y = torch.as_tensor(np.asarray(labels), dtype=torch.long)
    return ArraySplit(x.contiguous().to(torch.uint8), y)


def _missing(name: str, root: Path, files: list[str], hint: str) -> DatasetUnavailable:
    listed = "\n".join(f"  {root / f}" for f in files)
    return DatasetUnavailable(
        f"dataset {name!r} is not available offline; missing:\n{listed}\n{hint}"
    )


_FMNIST_HINT = (
    "install Debian's dataset-fashion-mnist (apt-get install dataset-fashion-mnist), "
    f"or point ${FMNIST_ENV} at a folder with its four .gz files, "
    "or set data.download: true where there is internet."
)


def _fmnist_missing(raw: Path, debian_dir: Path) -> tuple[list[str], bool]:
    """Idx files absent from `raw`, and whether Debian's package can supply all of them."""
    missing = [f for f in _FMNIST_FILES if not (raw / f).is_file()]
    return missing, all((debian_dir / f"{f}.gz").is_file() for f in missing)


def fashion_mnist_missing(root: Path, download: bool, debian_dir: Path | None = None) -> str | None:
    """The message `prepare_fashion_mnist` would raise, found without touching any file."""
    raw = root / "FashionMNIST" / "raw"
    missing, from_debian = _fmnist_missing(raw, debian_dir or fashion_mnist_source())
    if not missing or from_debian or download:
        return None
    return str(_missing("fashion-mnist", raw, missing, _FMNIST_HINT))


def prepare_fashion_mnist(root: Path, download: bool, debian_dir: Path | None = None) -> Path:
    """Put the raw idx files where torchvision looks (`<root>/FashionMNIST/raw/`)."""
    raw = root / "FashionMNIST" / "raw"
    debian_dir = debian_dir or fashion_mnist_source()
    missing, from_debian = _fmnist_missing(raw, debian_dir)
    if missing and from_debian:
        raw.mkdir(parents=True, exist_ok=True)
        for f in missing:
            tmp = raw / f"{f}.{os.getpid()}.part"  # jobs of a grid may unpack at once
            with gzip.open(debian_dir / f"{f}.gz", "rb") as src, open(tmp, "wb") as dst:
                shutil.copyfileobj(src, dst)
            tmp.replace(raw / f)
        missing = []
    if missing and not download:
        raise _missing("fashion-mnist", raw, missing, _FMNIST_HINT)
    return raw


def _fmnist_sources(root: Path) -> list[Path]:
    return [root / "FashionMNIST" / "raw" / f for f in _FMNIST_FILES]


def _fmnist_fingerprint(root: Path) -> str | None:
    """The idx files' content: unpacked under `root` once a job has put them there, read from
    the packed copy before (the same bytes, so unpacking reruns nothing)."""
    from dpadapter.data.manifest import file_fingerprint

    cache = root / ".cache" / "manifests"
    raw = _fmnist_sources(root)
    if all(p.is_file() for p in raw):
        return file_fingerprint({p.name: p for p in raw}, cache)
    packed = fashion_mnist_source()
    return file_fingerprint({f: packed / f"{f}.gz" for f in _FMNIST_FILES}, cache, gzip.open)


def _torchvision_sources(files: list[str]):
    """The files torchvision reads: each named file, and the files directly in each folder."""

    def sources(root: Path) -> list[Path]:
        out = []
        for f in files:
            p = root / f
            if f.endswith("/") and p.is_dir():
                out += sorted(c for c in p.iterdir() if c.is_file())
            else:
                out.append(p)
        return out

    return sources


def _torchvision_missing(name: str, files: list[str]):
    """A cheap look for the files torchvision reads (a folder name ends with /)."""

    def missing(root: Path, download: bool) -> str | None:
        absent = [f for f in files if not (root / f).exists()]
        if not absent or download:
            return None
        return str(_missing(name, root, absent, "set data.download: true where there is internet"))

    return missing


_CIFAR10_FILES = ["cifar-10-batches-py/"]
_CIFAR100_FILES = ["cifar-100-python/"]
_SVHN_FILES = ["train_32x32.mat", "test_32x32.mat"]
_STL10_FILES = ["stl10_binary/"]
# SVHN's classes are unbalanced (digit 0 is label 0, as torchvision maps it).
_SVHN_TRAIN = (4948, 13861, 10585, 8497, 7458, 6882, 5727, 5595, 5045, 4659)
_SVHN_TEST = (1744, 5099, 4149, 2882, 2523, 2384, 1977, 2019, 1660, 1595)


@register_dataset(
    "fashion-mnist",
    DatasetInfo(
        (6000,) * 10,
        (1000,) * 10,
        fashion_mnist_missing,
        channels=1,
        sources=_fmnist_sources,
        fingerprint=_fmnist_fingerprint,
    ),
)
def fashion_mnist(root: Path, download: bool) -> tuple[ArraySplit, ArraySplit]:
    prepare_fashion_mnist(root, download)
    tv = import_torchvision()
    out = []
    for train in (True, False):
        ds = tv.datasets.FashionMNIST(str(root), train=train, download=download)
        out.append(_as_split(ds.data, ds.targets, channels_last=False))
    return out[0], out[1]


def _torchvision_pair(
    name, cls_name, root, download, files, kw_train, kw_test, label_attr, channels_last
):
    tv = import_torchvision()
    cls = getattr(tv.datasets, cls_name)
    try:
        tr = cls(str(root), download=download, **kw_train)
        te = cls(str(root), download=download, **kw_test)
    except RuntimeError as exc:  # torchvision: "Dataset not found or corrupted"
        raise _missing(
            name, root, files, f"set data.download: true where there is internet ({exc})"
        ) from exc
    except OSError as exc:  # download failed (no network)
        raise _missing(name, root, files, f"download failed: {exc}") from exc
    return (
        _as_split(tr.data, getattr(tr, label_attr), channels_last),
        _as_split(te.data, getattr(te, label_attr), channels_last),
    )


@register_dataset(
    "cifar10",
    DatasetInfo(
        (5000,) * 10,
        (1000,) * 10,
        _torchvision_missing("cifar10", _CIFAR10_FILES),
        3,
        sources=_torchvision_sources(_CIFAR10_FILES),
    ),
)
def cifar10(root: Path, download: bool):
    return _torchvision_pair(
        "cifar10",
        "CIFAR10",
        root,
        download,
        _CIFAR10_FILES,
        {"train": True},
        {"train": False},
        "targets",
        True,
    )


@register_dataset(
    "cifar100",
    DatasetInfo(
        (500,) * 100,
        (100,) * 100,
        _torchvision_missing("cifar100", _CIFAR100_FILES),
        3,
        sources=_torchvision_sources(_CIFAR100_FILES),
    ),
)
def cifar100(root: Path, download: bool):
    return _torchvision_pair(
        "cifar100",
        "CIFAR100",
        root,
        download,
        _CIFAR100_FILES,
        {"train": True},
        {"train": False},
        "targets",
        True,
    )


@register_dataset(
    "svhn",
    DatasetInfo(
        _SVHN_TRAIN,
        _SVHN_TEST,
        _torchvision_missing("svhn", _SVHN_FILES),
        3,
        sources=_torchvision_sources(_SVHN_FILES),
    ),
)
def svhn(root: Path, download: bool):
    return _torchvision_pair(
        "svhn",
        "SVHN",
        root,
        download,
        _SVHN_FILES,
        {"split": "train"},
        {"split": "test"},
        "labels",
        False,
    )


@register_dataset(
    "stl10",
    DatasetInfo(
        (500,) * 10,
        (800,) * 10,
        _torchvision_missing("stl10", _STL10_FILES),
        3,
        sources=_torchvision_sources(_STL10_FILES),
    ),
)
def stl10(root: Path, download: bool):
    return _torchvision_pair(
        "stl10",
        "STL10",
        root,
        download,
        _STL10_FILES,
        {"split": "train"},
        {"split": "test"},
        "labels",
        False,
    )


# labels are arange(n) % 10 of the default sizes: exactly 300 / 100 per class. No `sources`:
# made by code in milliseconds, so never cached (a cache could outlive a change of this code).
@register_dataset("synthetic", DatasetInfo((300,) * 10, (100,) * 10, channels=1))
def synthetic(root: Path, download: bool, n_train: int = 3000, n_test: int = 1000):
    """Ten classes of 1x16x16 images: a fixed random template per class plus pixel noise.

    Small and learnable in a few steps, so tests exercise the real training code in seconds.
    """
    import torch

    g = torch.Generator().manual_seed(20261121)
    templates = torch.rand(10, 1, 16, 16, generator=g)

    def make(n: int) -> ArraySplit:
        y = torch.arange(n) % 10
        y = y[torch.randperm(n, generator=g)]
        x = templates[y] * 0.7 + 0.3 * torch.rand(n, 1, 16, 16, generator=g)
        return ArraySplit((x * 255).round().to(torch.uint8), y)

    return make(n_train), make(n_test)
