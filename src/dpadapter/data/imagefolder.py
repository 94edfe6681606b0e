"""A user's image folder as a dataset: `imagefolder:<path>@<side>`.

The Pretrain-DPFL paper pre-trains on ImageNet resized to 32x32; nobody may download ImageNet
for a user, so the public set can be a local folder in torchvision's ImageFolder layout,
`<data.root>/<path>/train/<class>/<image>` and `<data.root>/<path>/val/<class>/<image>` (the
test split; ImageNet's val folder sorted into class folders), e.g. `imagefolder:imagenet@32`.

- Classes are the train folder's class folders in sorted order (ImageFolder's convention), so
  labels are 0..K-1 in that order; a val class folder must be one of them (a class with no val
  images has none in the test split).
- Every image is read once, converted to RGB and resized to `side` x `side` (whole image, no
  crop, PIL's box filter: area averaging, as the downsampled-ImageNet variants are made; JPEGs
  are decoded at a reduced scale first). `load_dataset` then keeps the result as one tensor
  file under `<data.root>/.cache/`, so later jobs never decode an image again; it is rebuilt
  when a split or class folder changes (an image added, removed or renamed); delete it after
  editing an image in place.
- The class counts that validation needs come from the folder listing (names only, no image is
  opened), read when the config is validated, so a missing folder or an empty class is an error
  before any job.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from dpadapter.data.registry import ArraySplit, DatasetInfo, DatasetUnavailable, register_family

# The loader imports numpy and torch; the listing (validation, at parse time) needs neither.
if TYPE_CHECKING:
    import numpy as np

PREFIX = "imagefolder"
SPLITS = ("train", "val")
# torchvision's ImageFolder extensions
EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


def parse_spec(spec: str) -> tuple[str, int]:
    """`<path>@<side>` -> (path, side)."""
    path, sep, side = spec.rpartition("@")
    if not sep or not path or not side.isdigit() or int(side) < 1:
        raise ValueError(
            f"dataset '{PREFIX}:{spec}': write {PREFIX}:<folder under data.root>@<side>, "
            f"e.g. {PREFIX}:imagenet@32 (images resized to side x side)"
        )
    return path, int(side)


def _images(folder: Path) -> list[str]:
    return sorted(
        e.name
        for e in os.scandir(folder)
        if e.name.lower().endswith(EXTENSIONS) and not e.name.startswith(".")
    )


def _listing(base: Path, split: str) -> dict[str, list[str]]:
    """Class folder -> its image files (sorted), for one split; refuses what would load wrong."""
    top = base / split
    if not top.is_dir():
        raise DatasetUnavailable(
            f"{top} is not a folder: an image folder needs {base}/train/<class>/<images> and "
            f"{base}/val/<class>/<images> (torchvision ImageFolder layout)"
        )
    classes = sorted(e.name for e in os.scandir(top) if e.is_dir() and not e.name.startswith("."))
    if not classes:
        raise DatasetUnavailable(f"{top} has no class folders")
    return {c: _images(top / c) for c in classes}


def read_listing(base: Path) -> tuple[list[str], dict[str, dict[str, list[str]]]]:
    """(classes, {split: {class: files}}): what the loader reads and the counts validation uses."""
    splits = {s: _listing(base, s) for s in SPLITS}
    classes = list(splits["train"])
    empty = [c for c, files in splits["train"].items() if not files]
    if empty:
        raise DatasetUnavailable(f"{base / 'train'}: class folders without images: {empty[:5]}")
    stray = sorted(set(splits["val"]) - set(classes))
    if stray:
        raise DatasetUnavailable(f"{base / 'val'}: class folders not in train/: {stray[:5]}")
    return classes, splits


def _read_image(path: Path, side: int) -> np.ndarray:
    import numpy as np
    from PIL import Image

    with Image.open(path) as img:
        img.draft("RGB", (side, side))  # JPEG: decode at the smallest scale >= side (fast)
        rgb = img.convert("RGB").resize((side, side), Image.Resampling.BOX)
        return np.array(rgb, dtype=np.uint8).transpose(2, 0, 1)  # a copy PIL no longer owns


def _read_split(
    base: Path, split: str, classes: list[str], files: dict[str, list[str]], side: int
) -> ArraySplit:
    import torch

    index = {c: i for i, c in enumerate(classes)}
    paths = [base / split / c / f for c in files for f in files[c]]
    labels = torch.tensor([index[c] for c in files for _ in files[c]], dtype=torch.long)
    images = torch.empty((len(paths), 3, side, side), dtype=torch.uint8)
    # PIL decodes outside the GIL: threads read several images at once
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        for i, arr in enumerate(pool.map(lambda p: _read_image(p, side), paths)):
            images[i] = torch.from_numpy(arr)
    return ArraySplit(images, labels)


def resolve(spec: str, root: Path):
    """(loader, DatasetInfo) of `imagefolder:<spec>` under `root`, from the folder listing."""
    path, side = parse_spec(spec)
    base = root / path
    if not base.is_dir():
        raise DatasetUnavailable(
            f"image folder {base} not found (dataset '{PREFIX}:{spec}' reads "
            f"{base}/train/<class>/ and {base}/val/<class>/ under data.root); copy or link the "
            f"folder there, e.g. ImageNet's ILSVRC2012 train and val sorted into class folders"
        )
    classes, splits = read_listing(base)
    counts = {s: tuple(len(splits[s].get(c, ())) for c in classes) for s in SPLITS}

    def loader(root_: Path, download: bool) -> tuple[ArraySplit, ArraySplit]:
        # the listing again: the folder may have changed since validation
        cls, sp = read_listing(root_ / path)
        return tuple(_read_split(root_ / path, s, cls, sp[s], side) for s in SPLITS)

    def sources(root_: Path) -> list[Path]:
        # the split and class folders: their mtimes change when an image is added, removed or
        # renamed (stat-ing every image of ImageNet would cost each job seconds)
        b = root_ / path
        return [b / s for s in SPLITS] + [b / s / c for s in SPLITS for c in sorted(splits[s])]

    return loader, DatasetInfo(counts["train"], counts["val"], channels=3, sources=sources)


register_family(PREFIX, resolve)
