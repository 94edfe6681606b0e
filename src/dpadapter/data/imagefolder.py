"""A user's image folder as a dataset: `imagefolder:<path>@<side>`.

The researcher's own private data (docs/your-data.md), or a public set such as ImageNet resized
to 32x32 (the Pretrain-DPFL paper pre-trains on it; nobody may download ImageNet for a user).
The layout is torchvision's ImageFolder: `<path>/train/<class>/<image>`,
`<path>/test/<class>/<image>` (the test split; `val/` alone is read as its old name, with a
note) and optionally `<path>/val/<class>/<image>` (or `validation/`) beside `test/`: the
validation split, which every task drawing on the folder uses as its validation examples
instead of carving `n_val` from train/ (`dpadapter.data.tasks`). `<path>` is under `data.root`
or absolute, e.g. `imagefolder:imagenet@32`.

- Classes are the train folder's class folders in sorted order (ImageFolder's convention), so
  labels are 0..K-1 in that order; a test or validation class folder must be one of them (a
  class with no such images needs no folder). The test folder is optional: without it, roles
  carve their test examples from train/ (`test_split: train`).
- Every file is decoded and checked when the config is validated, before any job
  (`dpadapter.data.manifest`: unreadable, non-image, empty class folders and images in two
  splits are refused, naming the files); the manifest remembers each file by path, size and
  mtime, and its content fingerprint is what the workflow's rerun triggers read.
- Grey stays grey: a folder whose images are all grey (PIL mode L, 1, I, ...) is a 1-channel
  dataset, any colour image makes it a 3-channel one (grey images replicated). How a folder's
  channels meet the public set's is the data checks' rule (`dpadapter.data.checks`).
- Every image is read once, resized to `side` x `side` (whole image, no crop, PIL's box filter:
  area averaging, as the downsampled-ImageNet variants are made; JPEGs are decoded at a reduced
  scale first). `load_dataset` keeps the result as one tensor file under `<data.root>/.cache/`,
  keyed by the manifest, so an image added, removed or edited in place rebuilds it.
"""

from __future__ import annotations

import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from dpadapter.data.manifest import EXTENSIONS, Scan, manifest_file, scan_folder
from dpadapter.data.registry import (
    SPLITS,
    ArraySplit,
    DatasetInfo,
    DatasetUnavailable,
    register_family,
)

# The loader imports numpy and torch; the check (validation, at parse time) needs neither.
if TYPE_CHECKING:
    import numpy as np

PREFIX = "imagefolder"
__all__ = ["EXTENSIONS", "PREFIX", "SPLITS", "parse_spec", "read_listing", "resolve"]
_NOTED: set[str] = set()


def parse_spec(spec: str) -> tuple[str, int]:
    """`<path>@<side>` -> (path, side)."""
    path, sep, side = spec.rpartition("@")
    if not sep or not path or not side.isdigit() or int(side) < 1:
        raise ValueError(
            f"dataset '{PREFIX}:{spec}': write {PREFIX}:<folder under data.root, or an absolute "
            f"path>@<side>, e.g. {PREFIX}:imagenet@32 (images resized to side x side)"
        )
    return path, int(side)


def read_listing(base: Path, root: Path | None = None) -> Scan:
    """The checked folder (every file decoded once, then remembered under
    `<root>/.cache/manifests/`); raises DatasetUnavailable with every problem found."""
    scan = scan_folder(base, (root if root is not None else base.parent) / ".cache" / "manifests")
    if scan.problems:
        # indented below the `key: text` line a config problem is (dpadapter.settings.problems
        # reads only lines indented by two spaces as problems of their own)
        raise DatasetUnavailable(
            f"image folder {base}:"
            + "".join("\n    - " + p.replace("\n  ", "\n        ") for p in scan.problems)
        )
    for note in scan.notes:
        if note not in _NOTED:
            _NOTED.add(note)
            print(f"note: {note}", file=sys.stderr)
    return scan


def _read_image(path: Path, side: int, channels: int) -> np.ndarray:
    import numpy as np
    from PIL import Image

    mode = "L" if channels == 1 else "RGB"
    with Image.open(path) as img:
        img.draft(mode, (side, side))  # JPEG: decode at the smallest scale >= side (fast)
        arr = np.array(img.convert(mode).resize((side, side), Image.Resampling.BOX), np.uint8)
        # a copy PIL no longer owns, channels first
        return arr[None] if channels == 1 else arr.transpose(2, 0, 1)


def _read_split(scan: Scan, split: str, side: int) -> ArraySplit:
    import torch

    files = scan.files.get(split, {})
    index = {c: i for i, c in enumerate(scan.classes)}
    paths = [scan.base / scan.rel(split, c, f) for c in files for f in files[c]]
    labels = torch.tensor([index[c] for c in files for _ in files[c]], dtype=torch.long)
    channels = scan.channels
    images = torch.empty((len(paths), channels, side, side), dtype=torch.uint8)
    # PIL decodes outside the GIL: threads read several images at once
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        for i, arr in enumerate(pool.map(lambda p: _read_image(p, side, channels), paths)):
            images[i] = torch.from_numpy(arr)
    return ArraySplit(images, labels)


def resolve(spec: str, root: Path):
    """(loader, DatasetInfo) of `imagefolder:<spec>` under `root`, from the checked folder."""
    path, side = parse_spec(spec)
    base = root / path  # an absolute path stays itself
    if not base.is_dir():
        raise DatasetUnavailable(
            f"image folder {base} not found (dataset '{PREFIX}:{spec}' reads "
            f"{base}/train/<class>/ and {base}/test/<class>/; a relative path is under "
            f"data.root, an absolute one is used as it is): copy or link the folder there, or "
            f"name it by its absolute path (docs/your-data.md)"
        )
    scan = read_listing(base, root)
    counts = {s: tuple(len(scan.files.get(s, {}).get(c, ())) for c in scan.classes) for s in SPLITS}

    def loader(root_: Path, download: bool) -> tuple[ArraySplit, ...]:
        # checked again: the folder may have changed since validation
        now = read_listing(root_ / path, root_)
        splits = SPLITS if "val" in now.folders else SPLITS[:2]  # test: empty when absent
        return tuple(_read_split(now, s, side) for s in splits)

    def sources(root_: Path) -> list[Path]:
        # the manifest, brought up to date here (a stat of each file): it is rewritten when an
        # image is added, removed or edited, which rebuilds the tensor cache
        read_listing(root_ / path, root_)
        return [manifest_file(root_ / ".cache" / "manifests", root_ / path)]

    return loader, DatasetInfo(
        counts["train"],
        counts["test"],
        val_counts=counts["val"] if "val" in scan.folders else None,
        channels=scan.channels,
        sources=sources,
        fingerprint=lambda root_: scan.fingerprint,
    )


register_family(PREFIX, resolve)
