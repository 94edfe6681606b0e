"""The HPO rules in the Snakemake DAG: its own target, the expected jobs of each regime (the
paper's linear probe unless the config says otherwise), not part of `all`."""

import copy
import os
import sys
from pathlib import Path

import pytest
import snakemake_runner  # tests/ is on sys.path
import yaml
from tiny_config import TINY_RAW

# Snakemake runs fork their jobs from the worker's fork servers (tests/conftest.py)
pytestmark = [pytest.mark.process, pytest.mark.usefixtures("module_fork_servers")]

REPO = Path(__file__).resolve().parents[2]


def _dry_run(wd: Path, *targets: str) -> str:
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{wd / 'mlruns.db'}"}
    cmd = [sys.executable, "-m", "snakemake", "--snakefile", str(REPO / "Snakefile"),
           "--directory", str(wd), "--cores", "2", "-n", *targets]  # fmt: skip
    r = snakemake_runner.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout + r.stderr


def _counts(out: str) -> dict[str, int]:
    counts = {}
    in_stats = False
    for line in out.splitlines():
        if line.startswith("job ") and "count" in line:
            in_stats = True
            continue
        if in_stats:
            parts = line.split()
            if len(parts) == 2 and parts[1].isdigit():
                counts[parts[0]] = int(parts[1])
            elif parts and parts[0] == "total":
                break
    return counts


def test_hpo_target_schedules_trials_sweeps_baselines_and_summary(tmp_path):
    raw = copy.deepcopy(TINY_RAW)
    raw["hpo"] = {
        "regime": "network",
        "upstreams": ["scratch"],
        "tasks": ["syn-shift"],
        "seeds": [0, 1],
        "sweep_epsilons": [0.2, 0.4, 0.6],
        "trials_per_sweep": 2,
        "fit": "quadratic",
        "target_epsilon": 2.0,
        "grid_size": 4,
    }
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(raw))
    c = _counts(_dry_run(tmp_path, "hpo"))
    # per seed: 3 sweeps x 2 trials, 3 selections; one grid of 4 points shared by the seeds
    assert c["hpo_plan"] == 2 and c["hpo_trial"] == 12 and c["hpo_sweep"] == 6
    assert c["hpo_fit"] == 2 and c["hpo_final"] == 2 and c["random_search"] == 2
    assert c["grid_run"] == 4 and c["grid_oracle"] == 1 and c["hpo_summary"] == 1
    assert c["pretrain"] == 1 and "warmup" not in c and "finetune" not in c


def test_hpo_is_not_part_of_the_default_target():
    text = (REPO / "Snakefile").read_text()
    assert 'include: "workflow/rules/hpo.smk"' in text
    lines = text[text.index("rule all:") :].splitlines()
    block = [lines[0]]
    for line in lines[1:]:
        if line and not line[0].isspace():
            break
        block.append(line)
    rule_all = "\n".join(block)
    assert "hpo" not in rule_all and "default_target: True" in rule_all


def test_linear_probe_regime_schedules_its_own_rules(tmp_path):
    raw = copy.deepcopy(TINY_RAW)
    raw["hpo"] = {
        "regime": "linear-probe",
        "upstreams": ["scratch"],
        "tasks": ["syn-shift"],
        "seeds": [0, 1, 2],
        "target_epsilons": [1.0, 2.0],
        "sweep_epsilons": [0.1, 0.2],
    }
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(raw))
    c = _counts(_dry_run(tmp_path, "hpo"))
    assert c["hpo_features"] == 1 and c["hpo_probe_oracle"] == 1 and c["hpo_probe_seed"] == 3
    assert c["hpo_probe_summary"] == 1 and "hpo_trial" not in c and "hpo_summary" not in c


def test_a_config_without_hpo_regime_runs_the_papers_linear_probe(tmp_path):
    """No `regime` key (configs/paper.yaml has no hpo section at all): the linear-probe rules are
    scheduled, at the default total budget, and the schema documents the same default."""
    from dpadapter.settings import HPOConfig, base_schema, from_dict

    raw = copy.deepcopy(TINY_RAW)
    raw["hpo"] = {"upstreams": ["scratch"], "tasks": ["syn-shift"], "seeds": [0, 1]}
    cfg = from_dict(raw)
    assert cfg.hpo.regime == "linear-probe" and cfg.hpo.budgets == (1.0,)
    assert from_dict(copy.deepcopy(TINY_RAW)).hpo == HPOConfig()
    hpo = base_schema()["properties"]["hpo"]["properties"]
    assert hpo["regime"]["default"] == HPOConfig().regime
    assert tuple(hpo["target_epsilons"]["default"]) == HPOConfig().target_epsilons
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(raw))
    c = _counts(_dry_run(tmp_path, "hpo"))
    assert c["hpo_features"] == 1 and c["hpo_probe_oracle"] == 1 and c["hpo_probe_seed"] == 2
    assert c["hpo_probe_summary"] == 1 and "hpo_trial" not in c and "hpo_plan" not in c
