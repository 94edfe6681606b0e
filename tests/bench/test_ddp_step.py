"""bench/cpu/ddp_step.py runs (tiny, two gloo processes) and reports the all-reduce's share."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.process

REPO = Path(__file__).resolve().parents[2]


def test_the_benchmark_times_one_and_two_processes(tmp_path):
    args = ["--procs", "1", "2", "--model", "cnn-gn", "--batch", "16", "--steps", "1"]
    cmd = [sys.executable, str(REPO / "bench/cpu/ddp_step.py"), *args, "--out", str(tmp_path)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = json.loads((tmp_path / "ddp_step.json").read_text())["rows"]
    assert [r["processes"] for r in rows] == [1, 2]
    assert rows[0]["allreduce_ms"] == 0 and rows[1]["allreduce_ms"] > 0
    assert all(r["step_ms"] > 0 for r in rows)
    assert "all-reduce share" in (tmp_path / "ddp_step.md").read_text()
