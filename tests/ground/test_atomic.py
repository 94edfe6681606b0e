"""Atomic writes by concurrent processes: unique temporary names, nothing half-written published."""

from __future__ import annotations

import multiprocessing as mp
import re
from pathlib import Path

import pytest
import torch

from dpadapter.ground import atomic

SRC = Path(__file__).resolve().parents[2] / "src" / "dpadapter"


def test_interleaved_writers_do_not_share_a_temporary(tmp_path):
    """Writer A is mid-write when writer B writes the same file whole: each publishes its own
    bytes (a fixed `x.tmp` would let B's rename publish A's truncated file, then A's fail)."""
    path = tmp_path / "model.pt"
    with atomic.replacing(path) as tmp_a:
        tmp_a.write_bytes(b"A" * 10)
        atomic.write_bytes(path, b"B" * 20)
        assert path.read_bytes() == b"B" * 20
        assert tmp_a.read_bytes() == b"A" * 10
    assert path.read_bytes() == b"A" * 10
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pt"]


def test_a_failed_write_keeps_the_previous_file(tmp_path):
    path = tmp_path / "metrics.json"
    path.write_text("finished")
    with pytest.raises(RuntimeError), atomic.replacing(path) as tmp:
        tmp.write_text("half")
        raise RuntimeError("killed")
    assert path.read_text() == "finished"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.json"]


def _save_many(path: str, value: int, n: int) -> None:
    for _ in range(n):
        atomic.torch_save({"v": torch.full((20_000,), float(value))}, path)


@pytest.mark.process
def test_concurrent_processes_always_leave_a_whole_file(tmp_path):
    path = tmp_path / "ckpt.pt"
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_save_many, args=(str(path), v, 15)) for v in (1, 2, 3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    v = torch.load(path, weights_only=True)["v"]
    assert v.numel() == 20_000 and bool((v == v[0]).all()) and float(v[0]) in (1.0, 2.0, 3.0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt"]


# A temporary name derived from the final name alone (`x.with_suffix(".tmp")`, `x + ".tmp"`)
# is shared by every process writing x.
FIXED_TMP = re.compile(r"""with_suffix\([^)]*\.tmp["']\)|\+ ["']\.tmp["']""")


def test_no_module_writes_through_a_fixed_temporary_name():
    offenders = [
        f"{f.relative_to(SRC)}:{i}"
        for f in sorted(SRC.rglob("*.py"))
        for i, line in enumerate(f.read_text().splitlines(), 1)
        if FIXED_TMP.search(line)
    ]
    assert not offenders, f"fixed temporary names (use dpadapter.ground.atomic): {offenders}"
