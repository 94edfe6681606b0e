"""A failing rerun never costs the results it was meant to replace.

Snakemake deletes a job's existing outputs before the job starts and deletes whatever it wrote
when it fails: a rerun forced by a changed config (the overwrite switch) or by changed data
that then fails (a corrupt file, an out-of-memory kill) used to leave neither the old results
nor new ones, while the summaries still showed the old numbers. So before any job starts
(`onstart`), the existing outputs of every job the run will start are kept as hard links under
`<results_dir>/.kept/<run>/` (no bytes copied; the jobs write new files, never into the old
ones), with Snakemake's record of how each was built. When the run fails (`onerror`), each job
whose outputs are now missing gets its previous outputs and records back, so the next run
still sees them as outdated and reruns them; a successful job's new outputs stay. The kept
links are removed when the run ends either way.

Hand-written: Snakemake's own `update()` flag backs up by copying and changes what a job
may assume of its outputs.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

KEPT = ".kept"


@dataclass
class Kept:
    """The previous outputs of one run's jobs: `jobs[i]` lists (output, its kept link, its
    Snakemake record) for each output of job i that existed."""

    folder: Path
    jobs: list[list[tuple[str, Path, Any]]] = field(default_factory=list)


def _link_or_copy(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    if src.is_dir():
        shutil.copytree(src, dst, copy_function=_link_file, symlinks=True)
    else:
        _link_file(src, dst)


def _link_file(src, dst) -> None:
    try:
        os.link(src, dst)
    except OSError:  # a file system without hard links
        shutil.copy2(src, dst)


def keep(
    results_dir: str | Path, jobs: list[list[str]], record: Callable[[str], Any]
) -> Kept | None:
    """Link the existing outputs of `jobs` (each job's output paths) under
    `<results_dir>/.kept/`; `record(path)` reads Snakemake's record of one. None: none exist."""
    folder = Path(results_dir) / KEPT / f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
    kept = Kept(folder)
    for outputs in jobs:
        existing = [o for o in outputs if os.path.lexists(o)]
        if not existing:
            continue
        rows = []
        for o in existing:
            link = folder / str(Path(o).resolve()).lstrip(os.sep)
            _link_or_copy(Path(o), link)
            rows.append((o, link, record(o)))
        kept.jobs.append(rows)
    return kept if kept.jobs else None


def restore(kept: Kept | None, put_record: Callable[[str, Any], None]) -> list[str]:
    """After a failed run: each job with an output missing now (Snakemake removed them, and
    what the failed job wrote) gets all its previous outputs and records back. Returns the
    restored paths; removes the kept links either way."""
    if kept is None:
        return []
    restored = []
    for rows in kept.jobs:
        if all(os.path.lexists(o) for o, _, _ in rows):
            continue  # the job finished (or never started: nothing was removed)
        for o, link, rec in rows:
            Path(o).parent.mkdir(parents=True, exist_ok=True)
            if link.is_dir():
                shutil.rmtree(o, ignore_errors=True)
                shutil.move(link, o)
            else:
                os.replace(link, o)
            if rec is not None:
                put_record(o, rec)
            restored.append(o)
    discard(kept)
    return restored


def discard(kept: Kept | None) -> None:
    """Remove the kept links (the run succeeded, or what failed was put back)."""
    if kept is not None:
        shutil.rmtree(kept.folder, ignore_errors=True)
        try:
            kept.folder.parent.rmdir()  # .kept/ itself, when no other run keeps anything
        except OSError:
            pass
