"""scikit-learn's bundled handwritten digits as a dataset: a third private domain with no download.

The DPAdapter paper averages three private tasks, one of them a shift to digits (CIFAR-10 to
SVHN). The embedded default's tasks are both Fashion-MNIST; `sklearn.datasets.load_digits`
(1,797 grey 8x8 images of ten digits, shipped inside scikit-learn's wheel) gives a garments ->
digits shift that runs offline wherever the pipeline's environment is installed.

The set has no train/test split of its own, so one is fixed here, by class and file order
(every third image of a class is a test image): the split depends on nothing but the file, so
every job, machine and seed carves the same one, and the class counts below are known before any
job starts (the config check reads them while the workflow parses, which imports no numpy).
Pixel values 0..16 are scaled to 0..255 so that the images go through the same uint8 path as
every other dataset (resizing to the public set's side and the public set's normalisation
happen in `data.tasks`, as for any task).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from dpadapter.data.registry import ArraySplit, DatasetInfo, register_dataset

NAME = "sklearn-digits"
# load_digits' images per class (0..9), and the test share: every TEST_EVERY-th of a class
CLASS_COUNTS = (178, 182, 177, 183, 181, 182, 181, 179, 174, 180)
TEST_EVERY = 3
TEST_COUNTS = tuple(n // TEST_EVERY for n in CLASS_COUNTS)
TRAIN_COUNTS = tuple(n - t for n, t in zip(CLASS_COUNTS, TEST_COUNTS, strict=True))
MAX_PIXEL = 16  # load_digits' pixel range is 0..16


def _data_file() -> Path | None:
    """The CSV inside the installed scikit-learn (found without importing it), or None."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / "datasets" / "data" / "digits.csv.gz"


def _missing(root: Path, download: bool) -> str | None:
    f = _data_file()
    if f is not None and f.is_file():
        return None
    return (
        f"dataset {NAME!r} reads scikit-learn's bundled digits "
        f"({f or 'sklearn/datasets/data/digits.csv.gz'}), which is not installed: "
        "install scikit-learn (requirements.txt pins it)"
    )


def _sources(root: Path) -> list[Path]:
    f = _data_file()
    return [f] if f is not None else []


def is_test(labels):
    """Which images are test images: every TEST_EVERY-th of its class, in file order."""
    import torch

    rank = torch.zeros_like(labels)
    for c in labels.unique():
        where = labels == c
        rank[where] = torch.arange(int(where.sum()))
    return rank % TEST_EVERY == TEST_EVERY - 1


@register_dataset(
    NAME,
    DatasetInfo(TRAIN_COUNTS, TEST_COUNTS, _missing, channels=1, sources=_sources),
)
def sklearn_digits(root: Path, download: bool) -> tuple[ArraySplit, ArraySplit]:
    import torch
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.as_tensor(d.images, dtype=torch.float32).mul(255.0 / MAX_PIXEL).round()
    images = x.clamp(0, 255).to(torch.uint8).unsqueeze(1).contiguous()
    labels = torch.as_tensor(d.target, dtype=torch.long)
    test = is_test(labels)
    return ArraySplit(images[~test], labels[~test]), ArraySplit(images[test], labels[test])
