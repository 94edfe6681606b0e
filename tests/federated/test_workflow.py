"""The federated target in Snakemake: the grid it schedules, and (opt-in) a run end to end."""

import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

# Snakemake runs fork their jobs from the worker's fork servers (tests/conftest.py)
pytestmark = [pytest.mark.process, pytest.mark.usefixtures("module_fork_servers")]

REPO = Path(__file__).resolve().parents[2]

FED = {
    "task": "syn-shift",
    "clients": 3,
    "min_client_size": 20,
    "rounds": 3,
    "seeds": [0, 1],
    "estimate_directions": 1,
    "eval_every": 3,
    "rounds_sweep": [2],
    "sweep_epsilons": {"gaussian": 2.0, "laplace": 50.0},
    "gaussian": {"epsilons": [1.0, 2.0], "max_grad_norm": 1.0, "lr": 0.5, "sample_rate": 0.5},
    "laplace": {"epsilons": [50.0], "max_grad_norm": 5.0, "lr": 0.5},
}


def _snakemake(workdir: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{workdir / 'mlruns.db'}"}
    cmd = [
        sys.executable,
        "-m",
        "snakemake",
        "--snakefile",
        str(REPO / "Snakefile"),
        "--directory",
        str(workdir),
        "--cores",
        "2",
        *args,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)


def _workdir(tmp_path, tiny_raw, fed):
    raw = {**tiny_raw, "federated": fed, "privacy": {"delta": 1e-5, "accountant": "rdp"}}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(raw))
    return tmp_path


def test_dry_run_schedules_the_grid_once(tmp_path, tiny_raw):
    r = _snakemake(_workdir(tmp_path, tiny_raw, FED), "-n", "federated")
    assert r.returncode == 0, r.stderr[-2000:]
    out = r.stdout + r.stderr
    # main grid: (scratch + standard x {ht, ft, ut}) x (2 gaussian + 1 laplace eps) x 2 seeds = 24;
    # sweep at T=2: 4 strategies x 2 mechanisms x 2 seeds = 16
    counts = dict(re.findall(r"^\s*(\w+)\s+(\d+)\s*$", out, flags=re.M))
    assert counts["federated_run"] == "40", out[-3000:]
    assert counts["federated_summary"] == "1" and counts["pretrain"] == "2"


@pytest.mark.slow
def test_federated_target_end_to_end(tmp_path, tiny_raw):
    """The federated target through Snakemake: pre-training, the clients' rounds for every
    strategy and mechanism, the summary, the rule file, the figure and the report's page.
    Skipped unless asked for until 2026-11-28 ("minutes on 2 cores"); it ran in 20 s alone
    (warm jobs forked), so `make test` runs it."""
    fed = {
        **FED,
        "seeds": [0],
        "rounds_sweep": [],
        "sweep_epsilons": {},
        "gaussian": {**FED["gaussian"], "epsilons": [2.0]},
    }
    wd = _workdir(tmp_path, tiny_raw, fed)
    r = _snakemake(wd, "federated")
    assert r.returncode == 0, r.stderr[-3000:]
    rows = list(csv.DictReader(open(wd / "results/summary/federated.csv")))
    assert {(x["strategy"], x["mechanism"]) for x in rows} == {
        (s, m) for s in ("scratch", "ht", "ft", "ut") for m in ("gaussian", "laplace")
    }
    rule = json.loads((wd / "results/summary/federated_rule.json").read_text())
    assert rule["n_cells"] == 2
    assert (wd / "results/figures/federated_accuracy_vs_epsilon.png").stat().st_size > 1000
    assert list((wd / "results/benchmarks/federated").rglob("*.tsv"))
    md = (wd / "results/summary/federated.md").read_text()
    assert "| standard | HT (head) |" in md and "(n=1)†" in md and "How to read this" in md
    # once the federated summary exists, the report gets its page (and its figures)
    dry = _snakemake(wd, "-n", "report_all")
    assert dry.returncode == 0 and "report_federated" in dry.stdout + dry.stderr, dry.stderr[-2000:]
