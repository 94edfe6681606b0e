"""Cluster-shaped jobs: the Slurm profile puts short jobs into shared allocations (issue 27).

Without a Slurm: `fake_slurm.py` stands in for sbatch and friends, creating the outputs of the
jobs each submission carries (read off the dry run) instead of running them, so the whole
default grid goes through the slurm executor plugin in seconds and every sbatch call it makes
is recorded. `tests/cluster/test_slurm.py` runs grouped jobs on a real one-node Slurm.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from cluster_helpers import REPO, VENV_BIN, job_env, tiny_workdir
from tiny_config import TINY_RAW

pytestmark = pytest.mark.slow

PROFILE = yaml.safe_load((REPO / "slurm" / "config.yaml").read_text())
CLIENTS = ["sbatch", "sacct", "squeue", "sacctmgr", "sshare", "scontrol", "sinfo", "scancel"]


def default_grid_raw() -> dict:
    """The embedded default (`config.yaml`: its upstreams, tasks, grids) on synthetic data."""
    raw = yaml.safe_load((REPO / "config.yaml").read_text())
    raw["public"] = dict(TINY_RAW["public"])
    del raw["tasks"]["fmnist-proxy"]  # the recipe search's public proxy: no job reads it
    for name, task in raw["tasks"].items():
        raw["tasks"][name] = {
            **task, "dataset": "synthetic", "n_train": 200, "n_val": 50, "n_test": 100
        }  # fmt: skip
    return raw


def _dry_run_jobs(text: str) -> tuple[dict[str, dict], list[str]]:
    """Jobs of a dry run ({rule:wildcards: {rule, outputs, runtime, gpu}}) and its group lines."""
    jobs = {}
    for block in re.split(r"\n(?=\s*rule \w+:)", text):
        m = re.match(r"\s*rule (\w+):", block)
        if not m or m.group(1) == "all":
            continue
        field = lambda name, b=block: re.search(rf"^\s+{name}: (.*)$", b, re.M)  # noqa: E731
        wildcards = field("wildcards")
        key = (
            m.group(1) + ":" + ",".join(sorted(wildcards.group(1).split(", ") if wildcards else []))
        )
        res = dict(kv.split("=", 1) for kv in field("resources").group(1).split(", "))
        bench = field("benchmark")  # Snakemake waits for it like for an output
        jobs[key] = {
            "rule": m.group(1),
            "outputs": field("output").group(1).split(", ") + ([bench.group(1)] if bench else []),
            "runtime": int(res["runtime"]),
            "gpu": int(res.get("gpu", 0)),
        }
    return jobs, re.findall(r"Group job (\S+) \(jobs", text)


def _fake_slurm(bin_dir: Path) -> None:
    bin_dir.mkdir()
    fake = Path(__file__).with_name("fake_slurm.py")
    for client in CLIENTS:
        (bin_dir / client).write_text(
            f'#!/bin/sh\nexec "{sys.executable}" "{fake}" {client} "$@"\n'
        )
        (bin_dir / client).chmod(0o755)


def _snakemake(root: Path, wd: Path, env: dict, *args: str) -> str:
    cmd = [
        str(VENV_BIN / "snakemake"), "--profile", "slurm",
        "--snakefile", str(REPO / "Snakefile"), "--directory", str(wd), *args,
    ]  # fmt: skip
    r = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    return r.stdout + r.stderr


def test_the_default_grid_goes_out_in_a_fifth_as_many_allocations(tmp_path):
    wd = tiny_workdir(tmp_path / "wd", default_grid_raw())
    root = tmp_path / "root"
    root.mkdir()
    (root / "slurm").symlink_to(REPO / "slurm")  # `--profile slurm` from a repository root
    state = tmp_path / "slurm-state"
    state.mkdir()
    _fake_slurm(tmp_path / "bin")
    env = job_env(wd, FAKE_SLURM_DIR=str(state))
    env["PATH"] = f"{tmp_path / 'bin'}:{env['PATH']}"

    # The dry run shows the grouping: one group of fine-tuning jobs per upstream model.
    jobs, groups = _dry_run_jobs(_snakemake(root, wd, env, "-n"))
    upstreams = {k.split("upstream=")[1].split(",")[0] for k in jobs if k.startswith("finetune:")}
    assert {f"finetune-{u}" for u in upstreams} == set(groups)
    (state / "outputs.json").write_text(json.dumps({k: j["outputs"] for k, j in jobs.items()}))

    # The real run through the executor plugin, each submission answered by the fake.
    _snakemake(
        root, wd, env,
        "--slurm-init-seconds-before-status-checks", "3", "--seconds-between-status-checks", "1",
        "--latency-wait", "5",
    )  # fmt: skip
    submissions = [json.loads(line) for line in open(state / "submissions.jsonl")]
    carried = [key for s in submissions for key in s["jobs"]]
    assert sorted(carried) == sorted(jobs), "every job submitted exactly once"
    assert len(jobs) >= 70, len(jobs)  # the default grid: warm-up, 5 upstreams, 64 fine-tunings
    assert 5 * len(submissions) <= len(jobs), (len(submissions), len(jobs))

    # The one-GPU limit is per group job, not on the workflow: the warm-up and the scratch
    # pre-training (both ready at the start, both on a GPU) go out before the first status
    # query, not one after the other.
    first_poll = json.loads(open(state / "polls.jsonl").readline())["submitted"]
    first_jobs = {k for s in submissions[:first_poll] for k in s["jobs"]}
    assert {"warmup:", "pretrain:upstream=scratch"} <= first_jobs, first_jobs

    cap = int(PROFILE["group-components"][0].rsplit("=", 1)[1])
    for s in submissions:
        argv = " ".join(s["argv"])
        members = [jobs[key] for key in s["jobs"]]
        rules = {j["rule"] for j in members}
        if len(members) > 1:  # a group: fine-tuning jobs of one upstream model, <= cap of them
            assert rules == {"finetune"} and len(members) <= cap, s["jobs"]
            assert len({k.split("upstream=")[1].split(",")[0] for k in s["jobs"]}) == 1
        # One GPU per allocation however many jobs it runs (they take turns), and the wall time
        # of all of them, one after another.
        gpus = re.findall(r"--gpus=(\S+)", argv)
        assert gpus == (["1"] if any(j["gpu"] for j in members) else []), argv
        minutes = int(s["argv"][s["argv"].index("-t") + 1])
        assert minutes == sum(j["runtime"] for j in members), argv
