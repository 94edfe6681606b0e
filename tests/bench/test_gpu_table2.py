"""bench/gpu/gpu_table2.py runs one cell through the stage entry points, without Snakemake.

On CPU with the tiny synthetic config and a made-up reference table: the cell's line shows our
accuracy beside the paper's number with wall time, s/step and the (absent) GPU memory; the
reference table is written; a second call reuses the finished cell instead of training again.
Its stage processes are forked from the worker's fork servers (`shared_fork_servers`) where they
are up, as a local Snakemake run's jobs are: the script's own logic is under test here, and a
forked job writes the same files as its own process (tests/launch/test_prefork.py).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.process

REPO = Path(__file__).resolve().parents[2]


def test_one_cell_without_snakemake(tiny_raw, tmp_path, shared_fork_servers):
    tiny_raw["results_dir"] = str(tmp_path / "results")
    tiny_raw["device"] = "cpu"
    tiny_raw["finetune"]["epochs"] = 1
    tiny_raw["reference"] = {
        "name": "a test table",
        "source": "nowhere",
        "upstream": "scratch",
        "task": "syn-shift",
        "improved": "dpsgd",
        "cells": [{"algorithm": "dpsgd", "epsilon": 1, "mean": 55.5, "std": 0.25}],
    }
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(tiny_raw))
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO / "src"),
        "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlruns.db'}",
        **shared_fork_servers.job_env(1),
    }
    cmd = [sys.executable, str(REPO / "bench" / "gpu" / "gpu_table2.py"), "--config", str(config)]
    cmd += ["--algo", "dpsgd", "--eps", "1", "--out", str(tmp_path / "out")]
    first = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True)
    assert first.returncode == 0, first.stderr[-3000:]
    line = next(ln for ln in first.stdout.splitlines() if ln.startswith("| dpsgd | 1 | 0 |"))
    assert "paper 55.50 ± 0.25" in line and line.endswith(f"| – | {platform.machine()} |")  # no GPU
    m = json.loads(
        (tmp_path / "results/finetune/scratch/syn-shift/dpsgd/eps1/seed0/metrics.json").read_text()
    )
    assert f"{100 * m['test_accuracy']:.2f}" in line
    assert f"{m['wall_time_s'] / m['privacy']['steps']:.3f}" in line
    assert "55.50 ± 0.25" in (tmp_path / "out" / "reference.md").read_text()
    again = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True)
    assert again.returncode == 0 and "reusing the finished cell" in again.stdout
    assert " finetune " not in again.stdout  # no second training job
    if shared_fork_servers.env:  # its jobs were forked, not started (the point of the fixture)
        served = shared_fork_servers.log.read_text()
        assert f"--out {tmp_path / 'results'}" in served, served[-2000:]
    outside = subprocess.run(
        [*cmd[:-4], "--algo", "dpsat", "--eps", "1"], env=env, capture_output=True, text=True
    )
    assert outside.returncode == 2 and "not in the config's grid" in outside.stderr
