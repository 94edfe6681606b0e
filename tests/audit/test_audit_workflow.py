"""The audit target in Snakemake: the grid follows the registry; a tiny run end to end."""

import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import snakemake_runner  # tests/ is on sys.path
import yaml

from dpadapter.algorithms import ALGORITHMS

# Snakemake runs fork their jobs from the worker's fork servers (tests/conftest.py)
pytestmark = [pytest.mark.process, pytest.mark.usefixtures("module_fork_servers")]

REPO = Path(__file__).resolve().parents[2]
AUDIT = {"epsilons": [1, 4], "task": "syn-same", "canaries": 200, "guesses": [20, 50], "epochs": 2}


def _snakemake(workdir: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{workdir / 'mlruns.db'}"}
    cmd = [sys.executable, "-m", "snakemake", "--snakefile", str(REPO / "Snakefile")]
    cmd += ["--directory", str(workdir), "--cores", "2", *args]
    return snakemake_runner.run(cmd, capture_output=True, text=True, env=env, timeout=600)


def _workdir(tmp_path, tiny_raw, audit):
    raw = {**tiny_raw, "audit": audit, "privacy": {"delta": 1e-5, "accountant": "rdp"}}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(raw))
    return tmp_path


def test_dry_run_audits_every_registered_algorithm(tmp_path, tiny_raw):
    r = _snakemake(_workdir(tmp_path, tiny_raw, AUDIT), "-n", "audit")
    assert r.returncode == 0, r.stderr[-2000:]
    counts = dict(re.findall(r"^\s*(\w+)\s+(\d+)\s*$", r.stdout + r.stderr, flags=re.M))
    # every registered algorithm and both federated mechanisms, at 2 epsilons
    assert counts["audit_run"] == str(2 * (len(ALGORITHMS) + 2))
    assert counts["audit_summary"] == "1"


def test_bad_audit_section_fails_before_any_job(tmp_path, tiny_raw):
    r = _snakemake(_workdir(tmp_path, tiny_raw, {**AUDIT, "algorithms": ["nope"]}), "-n", "audit")
    assert r.returncode != 0
    assert "audit.algorithms: unknown algorithm 'nope'" in r.stdout + r.stderr


@pytest.mark.slow
def test_audit_target_end_to_end(tmp_path, tiny_raw):
    audit = {**AUDIT, "algorithms": ["dpsgd"], "epsilons": [1], "federated": ["gaussian"]}
    wd = _workdir(tmp_path, tiny_raw, audit)
    r = _snakemake(wd, "audit")
    assert r.returncode == 0, r.stderr[-3000:]
    rec = json.loads((wd / "results/audit/dpsgd/eps1/audit.json").read_text())
    assert rec["canaries"] == 200 and rec["epsilon_lb"] <= rec["claimed_epsilon"]
    rows = list(csv.DictReader(open(wd / "results/summary/audit.csv")))
    got = [(x["algorithm"], float(x["target_epsilon"])) for x in rows]
    assert got == [("dpsgd", 1.0), ("federated-gaussian", 1.0)]
    fed = json.loads((wd / "results/audit/federated-gaussian/eps1/audit.json").read_text())
    assert fed["epsilon_lb"] <= fed["claimed_epsilon"] and fed["steps"] == 20
    md = (wd / "results/summary/audit.md").read_text()
    assert "| dpsgd |" in md and "(n=1)†" in md and "How to read this" in md
    dry = _snakemake(wd, "-n", "report_all")  # the report gets an audit page
    assert dry.returncode == 0 and "report_audit" in dry.stdout + dry.stderr, dry.stderr[-2000:]
    assert (wd / "results/figures/audit_lower_bound.png").stat().st_size > 0
