"""Experiments are kept apart: everything a config produces lies under its results folder, and a
changed config that would overwrite another config's results says so before any job runs."""

from __future__ import annotations

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

from dpadapter.settings import from_dict
from dpadapter.workflow.identity import (
    IDENTITY_FILE,
    OVERWRITE_ENV,
    check,
    config_hash,
    record,
    sections,
)

# Snakemake runs fork their jobs from the worker's fork servers (tests/conftest.py)
pytestmark = [pytest.mark.process, pytest.mark.usefixtures("module_fork_servers")]

REPO = Path(__file__).resolve().parents[2]


def _snakemake(wd: Path, *args: str, **env_extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", OVERWRITE_ENV)}
    env.update(env_extra)
    cmd = [sys.executable, "-m", "snakemake", "--snakefile", str(REPO / "Snakefile"),
           "--directory", str(wd), "--cores", "1", *args]  # fmt: skip
    return snakemake_runner.run(cmd, capture_output=True, text=True, env=env, timeout=600)


def test_identity_names_the_sections_that_differ(tiny_raw, tmp_path):
    tiny_raw["results_dir"] = str(tmp_path / "res")
    a = from_dict(tiny_raw)
    assert check(a) is None  # nothing recorded yet
    record(a)
    assert check(a) is None
    tiny_raw["finetune"]["lr"] = 0.123
    tiny_raw["pretrain"]["methods"] = ["scratch"]
    tiny_raw["tracking"] = {"experiment": "elsewhere"}  # where runs go, not what results are
    tiny_raw["device"] = "cpu"  # where jobs run, likewise
    b = from_dict(tiny_raw)
    assert config_hash(b) != config_hash(a)
    msg = check(b)
    assert msg is not None
    # pretrain.methods only shrank the grid (test_a_grown_grid_is_the_same_experiment)
    assert "Sections that differ: finetune\n" in msg
    assert "finetune.lr: 0.5 -> 0.123" in msg and OVERWRITE_ENV in msg and "results_dir" in msg
    record(b)
    stored = json.loads((tmp_path / "res" / IDENTITY_FILE).read_text())
    assert stored["hash"] == config_hash(b) and stored["sections"] == sections(b)
    assert [p["hash"] for p in stored["previous"]] == [config_hash(a)]


def _drop(stored: dict, key: str) -> None:
    *path, last = key.split(".")
    d = stored["sections"]
    for p in path:
        d = d[p]
    del d[last]


def test_an_option_added_by_an_upgrade_is_no_difference_at_its_default(tiny_raw, tmp_path):
    """A results folder recorded by older code lacks the options added since; at their
    defaults (which keep what older code did) they are not a change, but set otherwise, or
    with any other key changed, the folder is still refused."""
    tiny_raw["results_dir"] = str(tmp_path / "res")
    a = from_dict(tiny_raw)
    record(a)
    path = tmp_path / "res" / IDENTITY_FILE
    stored = json.loads(path.read_text())
    for key in ("finetune.precision", "model.batchnorm", "tasks.syn-same.channels"):
        _drop(stored, key)  # as older code wrote it
    stored["hash"] = "0" * 16
    path.write_text(json.dumps(stored))
    assert check(a) is None
    tiny_raw["finetune"]["precision"] = "bf16"
    msg = check(from_dict(tiny_raw))
    assert msg is not None and "finetune.precision: '(unset)' -> 'bf16'" in msg
    tiny_raw["finetune"]["precision"] = "fp32"
    tiny_raw["finetune"]["lr"] = 0.123
    assert "finetune.lr: 0.5 -> 0.123" in check(from_dict(tiny_raw))


@pytest.mark.slow
def test_a_config_keeps_its_outputs_and_refuses_to_overwrite_another(tiny_raw, tmp_path):
    wd = tmp_path
    (wd / "config.yaml").write_text(yaml.safe_dump(tiny_raw))
    # A dry run writes no identity (nor anything else the identity check needs).
    r = _snakemake(wd, "-n", "results/warmup/model.pt")
    assert r.returncode == 0, r.stderr[-3000:]
    assert not (wd / "results" / IDENTITY_FILE).exists()

    r = _snakemake(wd, "results/warmup/model.pt")
    assert r.returncode == 0, r.stderr[-3000:]
    res = wd / "results"
    # logs, benchmarks and the MLflow store are the config's own, under its results folder
    assert (res / "logs" / "warmup.log").is_file()
    assert (res / "benchmarks" / "warmup.tsv").is_file()
    assert (res / "mlruns.db").is_file()
    assert len(list((res / "mlartifacts").glob("*/artifacts/metrics.json"))) == 1
    assert not any((wd / d).exists() for d in ("logs", "benchmarks", "mlruns.db", "mlruns"))
    assert (res / IDENTITY_FILE).is_file()
    model = res / "warmup" / "model.pt"
    before = (model.stat().st_mtime_ns, model.read_bytes())

    # Another config pointed at the same folder: the dry run warns, naming the section ...
    tiny_raw["warmup"]["lr"] = 0.02
    (wd / "config.yaml").write_text(yaml.safe_dump(tiny_raw))
    r = _snakemake(wd, "-n", "results/warmup/model.pt")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "holds results of another config" in r.stderr and "differ: warmup" in r.stderr
    # ... the real run refuses before any job, and the finished checkpoint is untouched ...
    r = _snakemake(wd, "results/warmup/model.pt")
    assert r.returncode != 0
    assert "refusing to run" in r.stdout + r.stderr
    assert "Traceback" not in r.stdout + r.stderr and "RuntimeError" not in r.stdout + r.stderr
    assert (model.stat().st_mtime_ns, model.read_bytes()) == before
    # ... its own results_dir keeps both ...
    r = _snakemake(wd, "-n", "results-b/warmup/model.pt", "--config", "results_dir=results-b")
    assert r.returncode == 0 and "another config" not in r.stderr, r.stderr[-3000:]
    # ... and the override replaces them on purpose.
    r = _snakemake(wd, "results/warmup/model.pt", **{OVERWRITE_ENV: "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert model.read_bytes() != before[1]
    assert "another config" not in _snakemake(wd, "-n", "results/warmup/model.pt").stderr


def test_records_in_a_list_that_gained_a_field_at_its_default_are_unchanged():
    from dpadapter.workflow.identity import _same_but_new_defaults

    old = [{"algorithm": "dpsgd", "mean": 80.0}]
    new = [{"algorithm": "dpsgd", "mean": 80.0, "task": None}]
    at_default = {"reference.cells.0.task"}
    assert _same_but_new_defaults("reference.cells", old, new, at_default)
    assert not _same_but_new_defaults("reference.cells", old, new, set())  # set on purpose
    changed = [{"algorithm": "dpsgd", "mean": 81.0, "task": None}]
    assert not _same_but_new_defaults("reference.cells", old, changed, at_default)


def test_a_grown_grid_is_the_same_experiment(tiny_raw, tmp_path):
    """Adding an upstream, task, algorithm, epsilon or seed adds jobs and overwrites none: no
    warning, no DPADAPTER_ALLOW_OVERWRITE; changing a setting (a task's size) still warns."""
    tiny_raw["results_dir"] = str(tmp_path / "res")
    record(from_dict(tiny_raw))
    grown = json.loads(json.dumps(tiny_raw))
    grown["pretrain"]["methods"] = ["scratch", "standard", "sam"]
    grown["finetune"].update(
        algorithms=["dpsgd", "dpsat"],
        epsilons=[1, 4, 8],
        seeds=[0, 1],
        upstreams=["scratch", "sam"],
    )
    grown["finetune"]["algo_params"] = {"dpsat": {"rho": 0.1}}
    grown["tasks"]["syn-more"] = dict(tiny_raw["tasks"]["syn-same"])
    assert check(from_dict(grown)) is None
    grown["tasks"]["syn-same"]["n_train"] = 123
    msg = check(from_dict(grown))
    assert msg is not None and "tasks.syn-same.n_train: 300 -> 123" in msg


def test_the_rerun_trigger_version_of_a_folder(tiny_raw, tmp_path):
    from dpadapter.workflow.fingerprint import CURRENT_VERSION
    from dpadapter.workflow.identity import fingerprint_version

    tiny_raw["results_dir"] = str(tmp_path / "new")
    cfg = from_dict(tiny_raw)
    assert fingerprint_version(cfg) == CURRENT_VERSION == 3
    record(cfg)
    assert json.loads((tmp_path / "new" / IDENTITY_FILE).read_text())["fingerprints"] == 3
    # a folder of finished jobs built before the version existed (no identity, or one without)
    tiny_raw["results_dir"] = str(tmp_path / "old")
    old = from_dict(tiny_raw)
    done = tmp_path / "old" / "finetune" / "scratch" / "syn-same" / "dpsgd" / "eps1" / "seed0"
    done.mkdir(parents=True)
    (done / "metrics.json").write_text("{}")
    assert fingerprint_version(old) == 1
    record(old)
    assert fingerprint_version(old) == 1  # kept for good


def test_growing_the_grid_plans_only_the_new_jobs(tiny_raw, tmp_path):
    """Snakemake end to end: after a finished run, an added upstream (in the explicit
    finetune.upstreams list) and epsilon plan only the new fine-tuning jobs, with no warning."""
    wd = tmp_path
    tiny_raw["tasks"] = {"syn-same": tiny_raw["tasks"]["syn-same"]}
    tiny_raw["finetune"].update(upstreams=["scratch"], epsilons=[1], epochs=1)
    tiny_raw["tracking"] = {"enabled": False}
    (wd / "config.yaml").write_text(yaml.safe_dump(tiny_raw))
    target = "results/finetune/scratch/syn-same/dpsgd/eps1/seed0/metrics.json"
    r = _snakemake(wd, target)
    assert r.returncode == 0, r.stderr[-3000:]
    tiny_raw["finetune"].update(upstreams=["scratch", "standard"], epsilons=[1, 4])
    (wd / "config.yaml").write_text(yaml.safe_dump(tiny_raw))
    grown = [
        f"results/finetune/{u}/syn-same/dpsgd/eps{e}/seed0/metrics.json"
        for u in ("scratch", "standard")
        for e in (1, 4)
    ]
    r = _snakemake(wd, "-n", *grown)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout + r.stderr
    assert "another config" not in out
    planned = re.findall(r"output: (results/finetune/\S+/metrics\.json)", out)
    assert sorted(planned) == sorted(grown[1:]), planned  # scratch at eps 1 is not rerun


def test_three_strategies_from_one_pretraining_in_one_table(tiny_raw, tmp_path):
    """finetune.strategies [ht, ft, ut] end to end: one pre-training, three fine-tuning jobs,
    one table with a strategy column; each job trained its own strategy; a fourth strategy
    added later plans its job only (and the table), with no warning."""
    wd = tmp_path
    tiny_raw["tasks"] = {"syn-same": tiny_raw["tasks"]["syn-same"]}
    tiny_raw["pretrain"]["methods"] = ["scratch"]
    tiny_raw["finetune"].update(epsilons=[1], epochs=1, strategies=["ht", "ft", "ut"])
    tiny_raw["tracking"] = {"enabled": False}
    (wd / "config.yaml").write_text(yaml.safe_dump(tiny_raw))
    r = _snakemake(wd, "results/summary/finetune.md")
    assert r.returncode == 0, r.stderr[-3000:]
    ran = re.findall(r"^(?:local)?rule (\w+):", r.stdout + r.stderr, flags=re.M)
    assert sorted(ran) == ["aggregate", "finetune", "finetune", "finetune", "pretrain"], ran
    rows = list(csv.DictReader(open(wd / "results" / "summary" / "finetune.csv")))
    assert sorted(r["strategy"] for r in rows) == ["ft", "ht", "ut"]
    md = (wd / "results" / "summary" / "finetune.md").read_text()
    assert "| Algorithm | Strategy | Upstream |" in md and "| dpsgd | ut, T₁ 50% | scratch |" in md
    jobs = wd / "results" / "finetune" / "scratch" / "syn-same"
    assert sorted(p.name for p in jobs.iterdir()) == ["dpsgd", "dpsgd+ht", "dpsgd+ut"]
    for folder, strategy in (("dpsgd", "ft"), ("dpsgd+ht", "ht"), ("dpsgd+ut", "ut")):
        m = json.loads((jobs / folder / "eps1" / "seed0" / "metrics.json").read_text())
        assert m["hyperparameters"]["strategy"] == strategy
        assert m["wildcards"].get("strategy") == (None if strategy == "ft" else strategy)
        phases = [p["phase"] for p in m["privacy"]["phases"]]
        assert phases == {"ft": ["ft"], "ht": ["ht"], "ut": ["ht", "ft"]}[strategy]
    # ht trains the head only: fewer released coordinates than ft
    dims = {
        f: json.loads((jobs / f / "eps1" / "seed0" / "metrics.json").read_text())["privacy"][
            "phases"
        ][0]["released_dim"]
        for f in ("dpsgd", "dpsgd+ht")
    }
    assert dims["dpsgd+ht"] < dims["dpsgd"]

    tiny_raw["finetune"]["strategies"] = ["ht", "ft", "ut", "bitfit"]
    (wd / "config.yaml").write_text(yaml.safe_dump(tiny_raw))
    r = _snakemake(wd, "-n", "results/summary/finetune.md")
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout + r.stderr
    assert "another config" not in out
    planned = re.findall(r"output: (results/finetune/\S+/metrics\.json)", out)
    assert planned == ["results/finetune/scratch/syn-same/dpsgd+bitfit/eps1/seed0/metrics.json"]
