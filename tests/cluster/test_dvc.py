"""DVC over the Snakemake pipeline as the docs say: run, push, lose everything, pull, carry on.

In a temporary git repository holding a copy of the project with the tiny config:
a plain `snakemake` run (what `make run` does) records its outputs in dvc.lock by itself (no
`dvc commit`), so `dvc push` right after it uploads the checkpoints. Then outputs, DVC cache
and Snakemake metadata are deleted (a fresh clone) and `dvc pull` restores the checkpoints
with modification times in no particular order (here the worst one: the warm-up newest).
With no other step, `snakemake -n` schedules no warm-up or pre-training job, and fine-tuning
from the pulled checkpoints reproduces the first results. The paper config's stages
(configs/paper/dvc.yaml) are part of the project and do not get in the way.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time
from pathlib import Path

import pytest
import snakemake_runner  # tests/ is on sys.path
import torch
import yaml
from cluster_helpers import REPO, VENV_BIN, job_env

pytestmark = pytest.mark.slow

PROJECT_FILES = [
    "Snakefile", "workflow", "src", "envs", "configs", "dvc.yaml", ".dvcignore", ".dvc/config",
    ".dvc/.gitignore", ".gitignore", "pyproject.toml", "requirements.txt",
]  # fmt: skip
ROOT_STAGES = ["warmup", "pretrain@scratch", "pretrain@standard", "finetune"]


def _run(cmd: list[str], cwd: Path, env: dict, timeout: float = 1200) -> str:
    # Snakemake's command line forked from the tests' server (tests/snakemake_runner.py): the
    # same `python -m snakemake` run, without its second of imports; dvc and git as processes.
    r = snakemake_runner.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{' '.join(cmd)} failed:\n{(r.stdout + r.stderr)[-5000:]}"
    return r.stdout + r.stderr


def _job_counts(dry_run_output: str) -> dict[str, int]:
    """The `Job stats` table of a Snakemake dry run: rule -> number of jobs."""
    table = dry_run_output.split("Job stats:", 1)[1].split("Reasons:", 1)[0]
    return {
        m[1]: int(m[2]) for m in re.finditer(r"^(\S+)\s+(\d+)\s*$", table, re.M) if m[1] != "total"
    }


def _finetune_results(results: Path) -> dict[str, tuple[dict, dict]]:
    out = {}
    for metrics in sorted((results / "finetune").rglob("metrics.json")):
        key = str(metrics.parent.relative_to(results))
        weights = torch.load(metrics.parent / "model.pt", weights_only=False)["state_dict"]
        out[key] = (json.loads(metrics.read_text()), weights)
    return out


def test_dvc_pull_then_snakemake_retrains_no_checkpoint(tiny_raw, tmp_path, shared_fork_servers):
    """Its runs' jobs come from the tests' fork servers (`shared_fork_servers`): which process
    runs a job changes none of its files (tests/launch/test_prefork.py)."""
    raw = tiny_raw
    raw["tasks"] = {"syn-shift": raw["tasks"]["syn-shift"]}
    raw["finetune"]["epsilons"] = [4]
    raw["finetune"]["epochs"] = 1
    repo = tmp_path / "repo"
    for rel in PROJECT_FILES:
        src, dst = REPO / rel, repo / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy2(src, dst)
    (repo / "config.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    (repo / ".venv").symlink_to(REPO / ".venv")  # dvc.yaml runs .venv/bin/snakemake
    env = job_env(repo, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t")
    env["GIT_COMMITTER_EMAIL"] = "t@t"
    dvc, smk = str(VENV_BIN / "dvc"), [sys.executable, "-m", "snakemake"]
    _run(["git", "init", "-q"], repo, env)
    (repo / ".git" / "info" / "exclude").write_text(".venv\n")
    _run(["git", "add", "-A"], repo, env)
    _run(["git", "commit", "-q", "-m", "project"], repo, env)

    # 1. The pipeline as `make run` runs it: plain Snakemake. It records its outputs in dvc.lock
    # itself, so the push right after it uploads them (no "Everything is up to date").
    _run([*smk, "--cores", "2"], repo, env)
    if shared_fork_servers.env:  # the run used them and started none of its own
        assert not (repo / "results" / "logs" / "prefork.log").exists()
    lock = yaml.safe_load((repo / "dvc.lock").read_text())["stages"]
    assert set(lock) == set(ROOT_STAGES)
    assert lock["pretrain@standard"]["deps"][0]["path"] == "results/warmup/model.pt"
    assert "up to date" in _run([dvc, "status", *ROOT_STAGES], repo, env)
    pushed = _run([dvc, "push"], repo, env)
    assert "Everything is up to date" not in pushed, pushed
    remote = tmp_path / "dpadapter-dvc-remote"  # .dvc/config: ../../dpadapter-dvc-remote
    n_pushed = sum(p.is_file() for p in remote.rglob("*"))
    n_outputs = sum(p.is_file() for p in (repo / "results" / "finetune").rglob("*"))
    assert n_pushed >= n_outputs + 6, (n_pushed, n_outputs)  # + warm-up and pre-training files
    before = _finetune_results(repo / "results")
    assert len(before) == 2

    # 2. A fresh clone: no outputs, no DVC cache, no Snakemake metadata. Pull the checkpoints.
    for rel in ("results", ".dvc/cache", ".snakemake"):
        shutil.rmtree(repo / rel, ignore_errors=True)
    _run([dvc, "pull", "warmup", "pretrain@scratch", "pretrain@standard"], repo, env)
    for rel in ("warmup/model.pt", "pretrain/scratch/model.pt", "pretrain/standard/model.pt"):
        assert (repo / "results" / rel).is_file(), rel
    assert not (repo / "results" / "finetune").exists()
    # The worst order the files can come back in: the warm-up newer than what was built on it.
    now = time.time()
    for p in (repo / "results" / "pretrain").rglob("*.*"):
        os.utime(p, (now - 120, now - 120))
    for p in (repo / "results" / "warmup").iterdir():
        os.utime(p, (now - 60, now - 60))

    # 3. No manual step: Snakemake schedules fine-tuning only ...
    jobs = _job_counts(_run([*smk, "-n", "--cores", "2"], repo, env))
    assert "warmup" not in jobs and "pretrain" not in jobs, jobs
    assert jobs.get("finetune") == 2, jobs

    # 4. ... and fine-tuning from the pulled checkpoints reproduces the first results.
    _run([*smk, "--cores", "2", "results/summary/finetune.csv"], repo, env)
    after = _finetune_results(repo / "results")
    assert sorted(after) == sorted(before)
    for key, (m_before, w_before) in before.items():
        m_after, w_after = after[key]
        assert m_after["privacy"] == m_before["privacy"], key
        assert m_after["test_accuracy"] == m_before["test_accuracy"], key
        assert all(torch.allclose(w_after[k], w_before[k], atol=1e-6) for k in w_before), key

    # 5. A whole pull (every stage, fine-tuning results too) leaves nothing to re-train either.
    for rel in ("results", ".snakemake"):
        shutil.rmtree(repo / rel, ignore_errors=True)
    # (`dvc pull dvc.yaml`: the default's stages; the paper's, never run here, have no lock yet)
    _run([dvc, "pull", "dvc.yaml"], repo, env)
    for p in (repo / "results" / "finetune").rglob("*"):
        os.utime(p, (now - 300, now - 300))
    jobs = _job_counts(_run([*smk, "-n", "--cores", "2"], repo, env))
    assert not {"warmup", "pretrain", "finetune", "aggregate"} & set(jobs), jobs
