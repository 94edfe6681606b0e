"""Files that appear whole or not at all, even when several processes write the same name.

A kill during a write must leave the previous file intact (so the temporary name, then
`os.replace`), and two processes writing the same file at once (concurrent Table 2 cells
pre-training the same upstream, Snakemake and a hand-run stage) must never share a temporary
name: with a fixed `x.tmp` the second writer truncates the first one's half-written file and the
first `os.replace` publishes it. Every temporary name here carries the process id and a random
suffix, and a failed write removes its own temporary file and nothing else.

Hand-written: the standard library has `os.replace` but no helper that names, writes, syncs and
cleans up in one place.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from pathlib import Path


def temporary_name(path: str | Path) -> Path:
    """A sibling of `path` that no other process (or thread of this one) will pick."""
    path = Path(path)
    return path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:12]}.tmp")


@contextlib.contextmanager
def replacing(path: str | Path, fsync: bool = False) -> Iterator[Path]:
    """Yield a temporary path to write; on success it becomes `path` in one rename.

    `fsync` flushes the bytes to disk before the rename (checkpoints: a machine crash must not
    leave an empty file under the final name)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_name(path)
    try:
        yield tmp
        if fsync:
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_bytes(path: str | Path, data: bytes, fsync: bool = False) -> None:
    with replacing(path, fsync) as tmp:
        tmp.write_bytes(data)


def write_text(path: str | Path, text: str, fsync: bool = False) -> None:
    with replacing(path, fsync) as tmp:
        tmp.write_text(text)


def torch_save(obj: object, path: str | Path, fsync: bool = False) -> None:
    import torch

    with replacing(path, fsync) as tmp:
        torch.save(obj, tmp)
