"""A dataset decoded once, then read by every later job from one tensor file.

Decoding idx, pickle, mat or image files costs a second or more per job (and imports
torchvision); a tensor file loads in a fraction of that. The file lives under
`<data.root>/.cache/` beside the prepared sources (on a cluster: the shared data folder, never a
results folder), and is trusted only while it provably holds what the sources would decode to:

- it records the format version and the sources' signature (path, size and mtime of every file
  or folder the loader reads), and is rebuilt when either differs: a source replaced, extended
  or re-downloaded invalidates it without anyone deleting it;
- it records a CRC-32 of each of its tensors' bytes (images and labels of train, test and, for
  a source with a validation split, val), checked on every load, so a truncated
  or corrupted file is rebuilt (and said so in the log) instead of training on wrong pixels;
- it is written to a file of its own process and renamed into place, so jobs of a grid that
  start together never read a half-written file (each may decode; the last rename wins, and
  all of them wrote the same bytes).

The sources' contents are not hashed here (seconds for large sets, every job). An image
folder's one source is its manifest (`dpadapter.data.manifest`), rewritten when any image is
added, removed or edited (a changed size or mtime), so such an edit rebuilds the cache.
"""

from __future__ import annotations

import json
import logging
import zlib
from collections.abc import Callable
from pathlib import Path

import torch

from dpadapter.ground import atomic

log = logging.getLogger(__name__)

FORMAT = 2  # 1: the unkeyed {"train", "test"} file of earlier versions
# (images, labels) of train and test, and of val for a source with a validation split
Tensors = tuple[tuple[torch.Tensor, torch.Tensor], ...]
# the file's keys of the splits, in the loaders' order (`registry.SPLITS`; not imported from
# there: the registry imports this module)
KEYS = ("train", "test", "val")


def signature(root: Path, paths: list[Path]) -> str:
    """What the cache is keyed by: each source's path (under root), size and mtime."""
    rows = []
    for p in paths:
        try:
            st = p.stat()
            rows.append([_rel(p, root), st.st_size, st.st_mtime_ns])
        except FileNotFoundError:
            rows.append([_rel(p, root), None, None])
    return json.dumps(rows)


def _rel(p: Path, root: Path) -> str:
    try:
        return str(p.relative_to(root))
    except ValueError:
        return str(p)


def _crc(t: torch.Tensor) -> int:
    """CRC-32 of the tensor's bytes, without copying them; an empty split (an image folder
    without test images: its test set comes from train) has the CRC of no bytes."""
    return zlib.crc32(t.contiguous().numpy().reshape(-1).view("uint8"))


def _check(d: object, name: str, source: str) -> tuple[Tensors | None, str]:
    """(the tensors, "") when `d` is a sound cache of these sources, else (None, why not)."""
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        return None, "an older format"
    if d.get("dataset") != name or d.get("source") != source:
        return None, "its source files changed"
    out = []
    for split in KEYS[: d.get("splits", 2)]:
        x, y = d[split]
        if x.dtype != torch.uint8 or x.ndim != 4 or y.dtype != torch.long or y.shape != x.shape[:1]:
            return None, f"bad {split} tensors"
        if [_crc(x), _crc(y)] != list(d["crc32"][split]):
            return None, f"its {split} tensors fail their checksum (corrupted)"
        out.append((x, y))
    return tuple(out), ""


def read(path: Path, name: str, source: str) -> Tensors | None:
    """The cached tensors, or None when there is no sound cache of these sources."""
    try:
        d = torch.load(path, weights_only=True)
    except FileNotFoundError:
        return None
    except Exception as exc:  # truncated / not a torch file: rebuilt, never trusted
        log.warning("dataset cache %s is unreadable (%s); decoding the sources again", path, exc)
        return None
    try:
        tensors, why = _check(d, name, source)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        tensors, why = None, f"malformed ({exc})"
    if tensors is None:
        log.warning("dataset cache %s is stale: %s; decoding the sources again", path, why)
    return tensors


def write(path: Path, name: str, source: str, tensors: Tensors) -> None:
    """Atomically: a temporary file of this process, renamed over `path`."""
    named = dict(zip(KEYS, tensors, strict=False))
    payload = {
        "format": FORMAT,
        "dataset": name,
        "source": source,
        "splits": len(named),
        **named,
        "crc32": {s: [_crc(x), _crc(y)] for s, (x, y) in named.items()},
    }
    atomic.torch_save(payload, path)


def load_or_build(
    path: Path,
    name: str,
    root: Path,
    sources: Callable[[], list[Path]],
    build: Callable[[], Tensors],
) -> Tensors:
    """The cache at `path` if it is sound for the current sources, else `build()` cached."""
    hit = read(path, name, signature(root, sources()))
    if hit is not None:
        return hit
    tensors = build()
    write(path, name, signature(root, sources()), tensors)  # after build: it may prepare them
    return tensors
