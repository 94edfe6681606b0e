"""The Snakemake workflow end to end on the tiny synthetic config (its results, then its report in
a browser), and dry runs of the real ones."""

import copy
import csv
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import snakemake_runner  # tests/ is on sys.path
import yaml
from report_browser import open_report
from tiny_config import TINY_RAW

pytestmark = pytest.mark.process

REPO = Path(__file__).resolve().parents[2]
SNAKEMAKE = [sys.executable, "-m", "snakemake"]


def _workdir(tmp_path: Path, raw: dict) -> Path:
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(raw))
    return tmp_path


def _snakemake(
    workdir: Path, *args: str, env_extra: dict | None = None
) -> subprocess.CompletedProcess:
    import os

    env = {
        **os.environ,
        "MLFLOW_TRACKING_URI": f"sqlite:///{workdir / 'mlruns.db'}",
        **(env_extra or {}),
    }
    cmd = [
        *SNAKEMAKE,
        "--snakefile",
        str(REPO / "Snakefile"),
        "--directory",
        str(workdir),
        "--cores",
        "2",
        *args,
    ]
    return snakemake_runner.run(cmd, capture_output=True, text=True, env=env, timeout=600)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """The tiny pipeline, run once for the module: its results and then its report."""
    wd = _workdir(tmp_path_factory.mktemp("tiny"), copy.deepcopy(TINY_RAW))
    return wd, _snakemake(wd)


@pytest.mark.slow
def test_pipeline_end_to_end_on_tiny_config(tiny_run):
    wd, r = tiny_run
    assert r.returncode == 0, r.stderr[-3000:]
    rows = list(csv.DictReader(open(wd / "results/summary/finetune.csv")))
    assert list(rows[0])[:8] == [
        "upstream",
        "task",
        "algorithm",
        "strategy",
        "epsilon",
        "mean_accuracy",
        "std_accuracy",
        "n_seeds",
    ]
    got = {(r["upstream"], r["task"], r["algorithm"], r["epsilon"]) for r in rows}
    want = {
        (u, t, "dpsgd", e)
        for u in ("scratch", "standard")
        for t in ("syn-same", "syn-shift")
        for e in ("1", "4")
    }
    assert got == want
    for r in rows:
        assert r["n_seeds"] == "1" and 0 <= float(r["mean_accuracy"]) <= 1
    md = (wd / "results/summary/finetune.md").read_text()
    assert "| dpsgd | standard |" in md and "syn-shift ε=4" in md
    assert "(n=1)†" in md and "How to read this" in md  # one seed: every cell is marked
    # every training job logged exactly one MLflow run, tagged with its stage, nested under the
    # one group run of its stage (parallel jobs made one each, not one per job)
    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{wd / 'mlruns.db'}")
    runs = mlflow.search_runs(experiment_names=["tests"])
    jobs, groups = runs[runs["tags.stage"].notna()], runs[runs["tags.stage"].isna()]
    assert len(jobs) == 1 + 2 + 8
    assert sorted(jobs["tags.stage"].value_counts().items()) == [
        ("finetune", 8),
        ("pretrain", 2),
        ("warmup", 1),
    ]
    group_of = dict(zip(groups["run_id"], groups["tags.dpadapter.group"], strict=True))
    assert sorted(g.split("/")[1] for g in group_of.values()) == ["finetune", "pretrain", "warmup"]
    for stage, parent in zip(jobs["tags.stage"], jobs["tags.mlflow.parentRunId"], strict=True):
        assert group_of[parent].endswith("/" + stage)
    # their files lie under the config's results folder
    assert all(
        u.startswith((wd / "results" / "mlartifacts").as_uri()) for u in runs["artifact_uri"]
    )
    # each metrics.json epsilon is within its target
    for p in (wd / "results/finetune").rglob("metrics.json"):
        m = json.loads(p.read_text())
        assert m["privacy"]["epsilon"] <= m["privacy"]["target_epsilon"]
    # the jobs ran in children of the run's preforked server (dpadapter.launch.prefork), which lists
    # them; the first may run on its own while the server imports
    forked = (wd / "results/logs/prefork.log").read_text()
    assert forked.count(" finetune ") == 8, forked
    # warm-up and pre-training (2 threads each) by a server of their own: three jobs, one import
    assert forked.count(" warmup ") == 1 and forked.count(" pretrain ") == 2, forked
    # a second invocation has nothing to do
    again = _snakemake(wd, "-n")
    assert "Nothing to be done" in again.stdout + again.stderr


def test_bad_config_fails_before_any_job(tmp_path, tiny_raw):
    tiny_raw["finetune"]["epsilons"] = ["four"]
    wd = _workdir(tmp_path, tiny_raw)
    r = _snakemake(wd)
    assert r.returncode != 0
    assert "finetune.epsilons.0" in r.stderr + r.stdout
    assert not (wd / "results" / "warmup").exists()


def test_paper_config_dry_run_shows_the_full_grid(tmp_path):
    shutil.copy(REPO / "configs/paper.yaml", tmp_path / "paper.yaml")
    r = _snakemake(tmp_path, "-n", "--configfile", str(tmp_path / "paper.yaml"))
    assert r.returncode == 0, r.stderr[-2000:]
    out = r.stdout + r.stderr
    # 5 upstreams x 3 tasks x 6 algorithms x 2 epsilons x 3 seeds, one warm-up
    counts = dict(re.findall(r"^(\w+)\s+(\d+)\s*$", out.split("Job stats:", 1)[1], re.M))
    assert counts["finetune"] == "540" and counts["pretrain"] == "5", counts
    assert counts["warmup"] == "1", counts


def test_warmup_runs_once_for_all_upstream_methods(tmp_path, tiny_raw):
    wd = _workdir(tmp_path, tiny_raw)
    r = _snakemake(wd, "-n")
    assert r.returncode == 0, r.stderr[-2000:]
    out = r.stdout + r.stderr
    assert "warmup           1" in out and "pretrain         2" in out


@pytest.mark.parametrize("name", ["dpsat-table2.yaml", "dpsat-table2-dpnas.yaml"])
def test_dpsat_table2_config_dry_run_shows_the_table(tmp_path, name):
    """3 algorithms x 3 epsilons x 5 seeds from scratch, and the paper-vs-ours table."""
    for f in (REPO / "configs").glob("dpsat-table2*.yaml"):  # the -dpnas one is an overlay
        shutil.copy(f, tmp_path / f.name)
    r = _snakemake(tmp_path, "-n", "--configfile", str(tmp_path / name))
    assert r.returncode == 0, r.stderr[-2000:]
    out = r.stdout + r.stderr
    counts = dict(re.findall(r"^(\w+)\s+(\d+)\s*$", out.split("Job stats:", 1)[1], re.M))
    assert counts["finetune"] == "45" and counts["reference"] == "1", counts
    assert "warmup" not in counts, counts


# Screenshots of the report as a browser shows it, kept for CI to publish.
ARTIFACTS = REPO / "results" / "test-artifacts"


def _chromium() -> str:
    exe = shutil.which("chromium")
    if exe:
        return exe
    why = REPO / ".venv" / ".no-chromium"  # `make browser` says why it could not install it
    if why.is_file():
        pytest.skip(f"chromium cannot be installed here: {why.read_text().strip()}")
    if shutil.which("apt-get") and os.geteuid() == 0:
        pytest.fail("chromium is missing although apt is usable: `make browser` installs it")
    pytest.skip("chromium is not installed and cannot be here (apt-get unusable or not root)")


@pytest.mark.slow
def test_report_shows_the_tables_and_figures_in_a_browser(tiny_run, shared_fork_servers):
    """`make report`'s two steps on the tiny run, then the report opened in headless Chromium.
    (Its page jobs fork from the worker's servers; the tiny run started and checked its own.)"""
    chromium = _chromium()
    wd, first = tiny_run
    assert first.returncode == 0, first.stderr[-3000:]
    built = _snakemake(wd, "report_all")
    assert built.returncode == 0, built.stderr[-3000:]
    html = wd / "results" / "report.html"
    made = _snakemake(wd, "--report", str(html), "report_all")
    assert made.returncode == 0, made.stderr[-3000:]
    ARTIFACTS.mkdir(parents=True, exist_ok=True)

    table = open_report(chromium, html, "table", ARTIFACTS / "report-finetune-table.png")
    assert table["categories"] == ["1. Fine-tuning", "2. Upstream robustness", "3. Speed"]
    assert table["table"] == "results/report/finetune.html"
    # the fine-tuning table, parsed by the browser from the report's own page: header and cells
    assert table["table_header"][:4] == ["Algorithm", "Upstream", "syn-same ε=1", "syn-same ε=4"]
    cells = table["table_cells"]
    width = len(table["table_header"])  # 2 keys, 2 tasks x 2 eps, 2 averages, 2 public columns
    rows = [cells[i : i + width] for i in range(0, len(cells), width)]
    assert [r[:2] for r in rows] == [["dpsgd", "scratch"], ["dpsgd", "standard"]], cells
    for r in rows:  # one seed, one pre-training run: every measured cell says n = 1
        assert all(re.fullmatch(r"\d+\.\d \(n=1\)†( \?)?", c) for c in r[2:6] + r[8:]), r
    # its caption says which config, how many seeds and what ε means
    caption = table["table_caption"]
    assert "config.yaml" in caption and "1 seed(s)" in caption
    assert "PRV accountant" in caption and "δ = 1e-05" in caption
    assert table["frame_shown"], "the table page is not displayed in the report's view"
    assert (ARTIFACTS / "report-finetune-table.png").stat().st_size > 10_000

    fig = open_report(chromium, html, "figure", ARTIFACTS / "report-figure.png")
    assert fig["figure"] == "results/figures/accuracy_vs_epsilon_dpsgd.png"
    assert fig["img_natural_width"] > 100  # decoded and laid out, not a broken image
    assert "error bars are the std over fine-tuning seeds" in fig["figure_caption"]
    assert (ARTIFACTS / "report-figure.png").stat().st_size > 10_000
