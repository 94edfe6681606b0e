"""A user's own checkpoints as the only upstreams, through `make run` and `make report` (issue 36).

The user of the issue saved timm checkpoints, wrote an overlay naming them as `external`
upstreams on a base whose optional sections (hpo, federated) name `standard` and `scratch`, and
ran the pipeline. On the code before this test every step failed: validation stopped on the
base's hpo and federated sections (pointing at the base), and once past it the `figures` job
found no public accuracy to plot, failed, and Snakemake deleted the figures it had made. Here
the same overlay, on a ViT and a BatchNorm ResNet the test saves, runs to its table, figures and
report; the unused sections are a warning that names the overlay's line; the `hpo` target is
refused with that message; a rerun job is told apart from the run it replaces in MLflow.
"""

from __future__ import annotations

import copy
import csv
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import snakemake_runner  # tests/ is on sys.path
import yaml
from external_helpers import params_for, save_as, source_model
from tiny_config import TINY_RAW

# Snakemake runs fork their jobs from the worker's fork servers (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("module_fork_servers")

REPO = Path(__file__).resolve().parents[2]
OVERLAY = """\
base: base.yaml
results_dir: res-mine
unset: [tasks.syn-same]
data:
  normalization: {mean: [0.0], std: [1.0]}
pretrain:
  methods: [vit, resnet]
  external: EXTERNAL
finetune:
  epochs: 1
"""


def snakemake(wd: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "snakemake", "--snakefile", str(REPO / "Snakefile")]
    cmd += ["--directory", str(wd), "--cores", "2", *args, "--configfile", str(wd / "mine.yaml")]
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{wd / 'mlruns.db'}"}
    return snakemake_runner.run(cmd, capture_output=True, text=True, env=env, timeout=600)


def make_workdir(wd: Path) -> Path:
    """A base like config.yaml (its hpo and federated sections name standard and scratch) and
    the user's overlay of two checkpoints of their own."""
    base = copy.deepcopy(TINY_RAW)
    base["hpo"] = {"upstreams": ["standard"], "tasks": ["syn-shift"]}
    base["federated"] = {
        "task": "syn-shift",
        "upstreams": ["standard"],
        "strategies": ["scratch", "ht"],
    }
    (wd / "base.yaml").write_text(yaml.safe_dump(base, sort_keys=False))
    external = {}
    for which in ("vit", "resnet"):
        path = save_as(source_model(which), wd / f"{which}.pth", "state_dict")
        external[which] = params_for(which, Path(path.name))
    text = OVERLAY.replace("EXTERNAL", yaml.safe_dump(external, default_flow_style=True).strip())
    (wd / "mine.yaml").write_text(text)
    return wd


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    wd = make_workdir(tmp_path_factory.mktemp("mine"))
    return wd, snakemake(wd)


def _line(wd: Path, needle: str) -> int:
    lines = (wd / "mine.yaml").read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if needle in line)


@pytest.mark.slow
def test_a_config_of_external_upstreams_runs_to_its_table_and_figures(run):
    wd, r = run
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    res = wd / "res-mine"
    # the base's sections this run does not use: a warning pointing at the overlay's line
    methods = _line(wd, "methods: [vit, resnet]")
    assert "warning: sections this run does not use do not fit this config" in out, out[-4000:]
    assert f"mine.yaml:{methods}: hpo.upstreams: 'standard' is not in pretrain.methods" in out
    assert f"mine.yaml:{methods}: federated.strategies: 'scratch' needs 'scratch'" in out
    # the table, with the public accuracy absent and the reason said
    md = (res / "summary" / "finetune.md").read_text()
    assert re.search(
        r"\| dpsgd \| vit \| [\d.]+ \(n=1\)† \| [\d.]+ \(n=1\)† .*\| n/a \| n/a \|", md
    )
    assert "n/a: no public accuracy is measured for vit, resnet: external weights" in md, md
    # every figure, the robustness one saying why it has no point to place
    figures = res / "figures"
    assert (figures / "accuracy_vs_epsilon_dpsgd.png").stat().st_size > 1000
    assert (figures / "robustness_vs_accuracy.png").stat().st_size > 1000
    rob = list(csv.DictReader(open(figures / "robustness_vs_accuracy.csv")))
    assert [(x["upstream"], x["public_test_accuracy"]) for x in rob] == [
        ("vit", ""),
        ("resnet", ""),
    ]


@pytest.mark.slow
def test_its_report_shows_what_exists_and_says_what_is_absent(run):
    wd, first = run
    assert first.returncode == 0, (first.stdout + first.stderr)[-4000:]
    built = snakemake(wd, "report_all")
    assert built.returncode == 0, (built.stdout + built.stderr)[-4000:]
    made = snakemake(wd, "--report", str(wd / "res-mine" / "report.html"), "report_all")
    assert made.returncode == 0, (made.stdout + made.stderr)[-4000:]
    pages = wd / "res-mine" / "report"
    upstream = pages.joinpath("upstream.html").read_text()
    assert "<td>vit</td>\n<td>n/a</td>" in upstream, upstream
    assert "no public accuracy is measured for vit, resnet: external weights come" in upstream
    speed = re.sub(r"\s+", " ", pages.joinpath("speed.html").read_text())
    # a ViT's and a ResNet's jobs are timed apart, not in one mean
    assert "<td>finetune</td> <td>timm:vit_tiny_patch16_224</td> <td>dpsgd</td>" in speed, speed
    assert "<td>finetune</td> <td>timm:resnet18</td> <td>dpsgd</td>" in speed, speed


@pytest.mark.slow
def test_the_hpo_target_is_refused_before_any_job_naming_the_overlay(run):
    wd, _ = run
    r = snakemake(wd, "-n", "hpo")
    out = r.stdout + r.stderr
    assert r.returncode != 0
    line = _line(wd, "methods: [vit, resnet]")
    assert f"mine.yaml:{line}: hpo.upstreams: 'standard' is not in pretrain.methods" in out, out
    assert "(hpo.upstreams is written at base.yaml:" in out, out
    assert "Traceback" not in out and "federated.strategies" not in out, out[-3000:]


@pytest.mark.slow
def test_a_rerun_job_is_told_apart_from_the_run_it_replaces(run):
    wd, first = run
    assert first.returncode == 0, (first.stdout + first.stderr)[-4000:]
    target = "res-mine/finetune/vit/syn-shift/dpsgd/eps1/seed0/metrics.json"
    again = snakemake(wd, "--forcerun", "finetune", target)
    assert again.returncode == 0, (again.stdout + again.stderr)[-4000:]
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{wd / 'mlruns.db'}")
    exp = client.get_experiment_by_name("tests")
    runs = client.search_runs(
        [exp.experiment_id],
        filter_string="tags.stage = 'finetune' and tags.upstream = 'vit' and tags.epsilon = '1'",
        order_by=["attributes.start_time ASC"],
    )
    names = [x.info.run_name for x in runs]
    assert names == [
        "finetune dpsgd vit syn-shift ε=1 s0 (replaced)",
        "finetune dpsgd vit syn-shift ε=1 s0 #2",
    ], names
    old, new = runs
    assert old.data.tags["dpadapter.replaced_by"] == new.info.run_id
    assert new.data.tags["dpadapter.replaces"] == old.info.run_id
    assert new.data.tags["dpadapter.attempt"] == "2"
