"""The Slurm profile without a Slurm: every entry explained, every GPU rule sent to a GPU
partition, and the resources Snakemake gives each job (dry run) are the profile's, with one
GPU per process for fine-tuning (`finetune.processes`) and pre-training (`pretrain.processes`)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml
from cluster_helpers import REPO, VENV_BIN, job_env, tiny_workdir

PROFILE_FILE = REPO / "slurm" / "config.yaml"
PROFILE = yaml.safe_load(PROFILE_FILE.read_text())
KEY = re.compile(r"^\s*[A-Za-z_][\w-]*:")


def _value(expr):
    return eval(str(expr), {"attempt": 1})


def test_every_entry_is_commented():
    bare = [
        f"{i}: {line}"
        for i, line in enumerate(PROFILE_FILE.read_text().splitlines(), 1)
        if KEY.match(line) and "#" not in line
    ]
    assert not bare, "profile entries without a comment:\n" + "\n".join(bare)


def test_profile_settings():
    assert PROFILE["executor"] == "slurm"
    assert PROFILE["latency-wait"] >= 60, "network file systems need a latency wait"
    assert PROFILE["retries"] >= 1
    default = PROFILE["default-resources"]
    assert _value(default["slurm_account"]) and _value(default["slurm_partition"])
    per_rule = PROFILE["set-resources"]
    for rule in ("warmup", "pretrain", "finetune"):
        assert _value(per_rule[rule]["slurm_partition"]) != _value(default["slurm_partition"])
        assert {"runtime", "mem_mb"} <= set(per_rule[rule])
    # the training rules keep their rules' gpu (finetune.processes, pretrain.processes): a fixed
    # entry here would win over it
    for rule in ("warmup", "pretrain", "finetune", "hpo_trial", "hpo_final", "grid_run"):
        assert "gpu" not in per_rule[rule], rule
    assert per_rule["aggregate"]["gpu"] == 0 and "slurm_partition" not in per_rule["aggregate"]
    # The limit inside a group allocation counts GPU jobs, not GPUs: a limit of gpu=1 would
    # refuse a group of k-GPU jobs ("Error grouping resources ... gpu: 2/1").
    assert PROFILE["resources"] == ["gpu_jobs=1"]
    assert PROFILE["set-resource-scopes"] == ["gpu_jobs=local"]


def _gpu_rules() -> set[str]:
    """Rules whose `resources:` in workflow/rules/*.smk ask for a GPU (`**gpu_job(...)`, the
    helper of common.smk, or a `gpu=` of their own)."""
    found, rule = set(), None
    for smk in sorted((REPO / "workflow" / "rules").glob("*.smk")):
        for line in smk.read_text().splitlines():
            if m := re.match(r"^(?:rule|checkpoint) (\w+):", line):
                rule = m.group(1)
            elif rule and re.match(r"^\s+(?:gpu\s*=\s*[1-9]|\*\*gpu_job\()", line):
                found.add(rule)
    return found


def test_every_gpu_rule_goes_to_a_gpu_partition():
    default = _value(PROFILE["default-resources"]["slurm_partition"])
    gpu_rules = _gpu_rules()
    assert {"warmup", "pretrain", "finetune"} <= gpu_rules
    missing = sorted(
        rule
        for rule in gpu_rules
        if _value(PROFILE["set-resources"].get(rule, {}).get("slurm_partition", repr(default)))
        == default
    )
    assert not missing, f"GPU rules left on the CPU partition {default!r}: {missing}"


def _dry_run_jobs(output: str) -> list[tuple[str, int, dict[str, str]]]:
    """(rule, threads, resources) of every job a dry run prints."""
    jobs = []
    for block in re.split(r"\n(?=\s*rule \w+:)", output):  # indented: a job inside a group
        m = re.match(r"\s*rule (\w+):", block)
        res = re.search(r"^\s+resources: (.*)$", block, re.M)
        if not m or not res:
            continue
        threads = re.search(r"^\s+threads: (\d+)$", block, re.M)
        resources = dict(kv.split("=", 1) for kv in res.group(1).split(", "))
        jobs.append((m.group(1), int(threads.group(1)) if threads else 1, resources))
    return jobs


def _profile_dry_run(tmp_path: Path, raw: dict) -> list[tuple[str, int, dict[str, str]]]:
    """The jobs of `snakemake --profile slurm -n` on `raw`, as `_dry_run_jobs` reads them."""
    wd = tiny_workdir(tmp_path / "wd", raw)
    root = tmp_path / "root"
    root.mkdir()
    (root / "slurm").symlink_to(REPO / "slurm")  # `--profile slurm` from a repository root
    r = subprocess.run(
        [str(VENV_BIN / "snakemake"), "--profile", "slurm", "-n",
         "--snakefile", str(REPO / "Snakefile"), "--directory", str(wd)],
        cwd=root, env=job_env(wd), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    return _dry_run_jobs(r.stdout + r.stderr)


@pytest.mark.slow
def test_dry_run_jobs_get_the_profile_resources(tiny_raw, tmp_path):
    jobs = _profile_dry_run(tmp_path, tiny_raw)
    seen = {rule for rule, _, _ in jobs}
    assert {"warmup", "pretrain", "finetune", "aggregate"} <= seen
    default = PROFILE["default-resources"]
    for rule, threads, res in jobs:
        if rule not in PROFILE["set-resources"]:
            continue
        want = {**default, **PROFILE["set-resources"][rule]}
        assert res["slurm_partition"] == _value(want["slurm_partition"]), rule
        assert res["slurm_account"] == _value(want["slurm_account"]), rule
        assert int(res["runtime"]) == _value(want["runtime"]), rule
        assert int(res["mem_mb"]) == _value(want["mem_mb"]), rule
        # training rules: their rule's one GPU per process (1 by default) on one node
        trains = rule in ("warmup", "pretrain", "finetune")
        assert int(res.get("gpu", 0)) == want.get("gpu", 1 if trains else 0), rule
        if int(res.get("gpu", 0)):
            assert res["nodes"] == "1" and res["gpu_jobs"] == "1", rule
        assert threads == min(PROFILE["set-threads"][rule], PROFILE["cores"]), rule


@pytest.mark.slow
def test_dry_run_finetune_gets_one_gpu_per_process(tiny_raw, tmp_path):
    """`finetune.processes: 2` asks for 2 GPUs on one node per fine-tuning job (sbatch
    --gpus=2 --nodes=1), with the profile unchanged; the other GPU rules keep one."""
    tiny_raw["finetune"]["processes"] = 2
    jobs = _profile_dry_run(tmp_path, tiny_raw)
    finetune = [res for rule, _, res in jobs if rule == "finetune"]
    assert len(finetune) == 8, jobs  # 2 upstreams x 2 tasks x 2 epsilons, in their groups
    for res in finetune:
        assert (res["gpu"], res["nodes"], res["gpu_jobs"]) == ("2", "1", "1"), res
        assert res["slurm_partition"] == _value(
            PROFILE["set-resources"]["finetune"]["slurm_partition"]
        )
    others = {rule: res["gpu"] for rule, _, res in jobs if rule in ("warmup", "pretrain")}
    assert set(others) == {"warmup", "pretrain"} and set(others.values()) == {"1"}, others


@pytest.mark.slow
def test_dry_run_pretraining_gets_one_gpu_per_process(tiny_raw, tmp_path):
    """`pretrain.processes: 3` asks for 3 GPUs on one node per warm-up and pre-training job;
    fine-tuning keeps its own (one)."""
    tiny_raw["pretrain"]["processes"] = 3
    jobs = _profile_dry_run(tmp_path, tiny_raw)
    for rule, _, res in jobs:
        if rule in ("warmup", "pretrain"):
            assert (res["gpu"], res["nodes"]) == ("3", "1"), (rule, res)
        elif rule == "finetune":
            assert res["gpu"] == "1", res


def test_profile_dir_is_found_from_the_repository_root():
    """`snakemake --profile slurm` looks for ./slurm/config.yaml (or profile.yaml)."""
    assert Path(REPO / "slurm" / "config.yaml").is_file()
    assert not (REPO / "slurm" / "profile.yaml").exists(), "two profile files would be ambiguous"
