"""configs/dpsat-table3.yaml, a paper config whose upstreams are all external, to its report.

Before issue 36 it could not finish: every fine-tuning job ran, then `figures` failed (no
public accuracy to plot) and no table was printed. The config is run as shipped, through an
overlay that swaps only what cannot run here: the five hub checkpoints for tiny ones of the
same timm families, CIFAR-10/100 for image folders of the same shape (RGB 32x32, 10 and 100
classes), and the sizes. The grid (5 models x 2 datasets x 2 algorithms x 2 budgets x 5 seeds,
the second block's extra grid) is the paper's: its dry run plans every job, and the stages after
training (aggregate, figures, the paper-vs-ours table, every page of the report) run on
finished metrics written here, and the whole config runs on one seed to its report: the
targets of `make run` and `make report` in one Snakemake call, then its `--report`.
"""

from __future__ import annotations

import copy
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
from external_helpers import save_table3_checkpoints, write_image_folder

# Snakemake runs fork their jobs from the worker's fork servers (tests/conftest.py)
pytestmark = [pytest.mark.process, pytest.mark.usefixtures("module_fork_servers")]

REPO = Path(__file__).resolve().parents[2]
RESULTS = "results/t3-tiny"


def snakemake(wd: Path, *args: str, config: str = "tiny.yaml") -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "snakemake", "--snakefile", str(REPO / "Snakefile")]
    cmd += ["--directory", str(wd), "--cores", "2", *args, "--configfile", str(wd / config)]
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{wd / 'mlruns.db'}"}
    return snakemake_runner.run(cmd, capture_output=True, text=True, env=env, timeout=900)


def make_workdir(wd: Path, seeds: list[int] | None = None) -> Path:
    shutil.copy(REPO / "configs" / "dpsat-table3.yaml", wd / "dpsat-table3.yaml")
    external = save_table3_checkpoints(wd / "weights")
    for params in external.values():
        params["weights"]["file"] = str(Path(params["weights"]["file"]).relative_to(wd))
    write_image_folder(wd / "data" / "c10", classes=10, train=20, test=6)
    # CIFAR-100's test images come from its training split (`test_split: train`): no test folder
    write_image_folder(wd / "data" / "c100", classes=100, train=3, test=0)
    overlay = {
        "base": "dpsat-table3.yaml",
        "results_dir": RESULTS,
        # the base's `weights: {hub: true}` would merge with a file: replace each label whole
        "unset": ["pretrain.external"],
        "data": {"download": False},
        "public": {"dataset": "imagefolder:c10@32", "n_train": 30, "n_test": 30},
        "tasks": {
            "cifar10": {"dataset": "imagefolder:c10@32", "n_train": 120, "n_test": 60},
            "cifar100": {"dataset": "imagefolder:c100@32", "n_train": 200, "n_test": 100},
        },
        "pretrain": {"external": copy.deepcopy(external)},
        "finetune": {"batch_size": 40, "physical_batch_size": 20, "epochs": 1},
    }
    if seeds is not None:
        overlay["finetune"]["seeds"] = seeds
    (wd / "tiny.yaml").write_text(yaml.safe_dump(overlay, sort_keys=False))
    return wd


def _counts(out: str) -> dict[str, str]:
    return dict(re.findall(r"^(\w+)\s+(\d+)\s*$", out.split("Job stats:", 1)[1], re.M))


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return make_workdir(tmp_path_factory.mktemp("table3"))


def test_the_dry_run_plans_the_papers_grid(workdir):
    r = snakemake(workdir, "-n")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    counts = _counts(out)
    # 5 models x 2 datasets x 2 algorithms x 5 seeds at eps 2; 3 models of the first block at 1
    assert counts["finetune"] == str(5 * 2 * 2 * 5 + 3 * 2 * 2 * 5), counts
    assert counts["pretrain"] == "5" and counts["reference"] == "1", counts
    assert counts["figures"] == "1" and "warmup" not in counts, counts
    assert "warning:" not in out, out[-4000:]


def _fabricate(wd: Path) -> None:
    """What the training jobs of the grid would have written: their metrics and checkpoints."""
    import dpadapter.settings as config

    raw = config.read_raw(wd / "tiny.yaml")
    cfg = config.from_dict(raw)
    res = wd / RESULTS
    why = "skipped: external weights come with a head trained on other classes than the public"
    for i, up in enumerate(cfg.upstreams):
        folder = res / "pretrain" / up
        folder.mkdir(parents=True)
        (folder / "model.pt").write_bytes(b"a checkpoint")
        m = {"stage": "pretrain", "wildcards": {"upstream": up}, "public_report": why,
             "wall_time_s": 3.0 + i}  # fmt: skip
        (folder / "metrics.json").write_text(json.dumps(m))
    for up, task, algo, eps, seed, _ in cfg.finetune_grid():
        folder = res / "finetune" / up / task / algo / f"eps{eps:g}" / f"seed{seed}"
        folder.mkdir(parents=True)
        (folder / "model.pt").write_bytes(b"a checkpoint")
        acc = (
            0.9 - 0.3 * (task == "cifar100") + 0.01 * eps + 0.002 * seed + 0.005 * (algo == "dpsat")
        )
        w = {"upstream": up, "task": task, "algo": algo, "eps": f"{eps:g}", "seed": str(seed)}
        m = {"stage": "finetune", "wildcards": w, "test_accuracy": acc,
             "test_robust_accuracy": acc - 0.05, "privacy": {"epsilon": 0.98 * eps},
             "wall_time_s": 10.0 * (1 + up.startswith("crossvit"))}  # fmt: skip
        (folder / "metrics.json").write_text(json.dumps(m))


def test_figures_tables_and_report_from_finished_metrics(workdir):
    _fabricate(workdir)
    after_training = ["aggregate", "figures", "reference", "report_all", "all"]
    after_training += [f"report_{p}" for p in ("finetune", "upstream", "speed", "reference")]
    # targets before --allowed-rules, which takes every name after it
    r = snakemake(workdir, "all", "report_all", "--allowed-rules", *after_training)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert not re.search(r"rule (pretrain|finetune):", out), out[-4000:]
    html = workdir / RESULTS / "report.html"
    made = snakemake(workdir, "--report", str(html), "report_all")
    assert made.returncode == 0, (made.stdout + made.stderr)[-4000:]
    assert html.stat().st_size > 100_000
    res = workdir / RESULTS
    ref = (res / "summary" / "reference.md").read_text()
    # one block per model and dataset, the paper's cells beside ours
    assert ref.count("\n## `") == 10, ref[:2000]
    assert "| 1 | 93.63 ± 0.14 | 91.40 ± 0.32 (5 seeds) |" in ref, ref[:2000]
    md = (res / "summary" / "finetune.md").read_text()
    assert "n/a: no public accuracy is measured for crossvit-18, vit-s, deit-b" in md, md
    for name in (
        "accuracy_vs_epsilon_dpsgd",
        "accuracy_vs_epsilon_dpsat",
        "robustness_vs_accuracy",
    ):
        assert (res / "figures" / f"{name}.png").stat().st_size > 1000
    speed = re.sub(r"\s+", " ", (res / "report" / "speed.html").read_text())
    for model in ("crossvit_9_240", "vit_small_patch16_224", "deit_base_patch16_224"):
        assert f"<td>finetune</td> <td>timm:{model}</td> <td>dpsgd</td>" in speed, speed


@pytest.mark.slow
def test_the_config_runs_to_its_report_on_one_seed(tmp_path, module_fork_servers):
    """All 32 jobs of one seed, cheaply (62 s of CPU, all processes, on a loaded 2-core machine;
    127 s as `make run` + `make report` with tracking and 3 draws): untracked
    (MLflow costs each job a store round trip), one robustness draw, and the pretrain jobs (a
    rule of `workflow.cores` threads) at the fork server's one thread, so that they are forked
    from it rather than each importing torch and timm."""
    wd = make_workdir(tmp_path, seeds=[0])
    overlay = yaml.safe_load((wd / "tiny.yaml").read_text())
    overlay.update(tracking={"enabled": False}, robustness={"draws": 1})
    (wd / "tiny.yaml").write_text(yaml.safe_dump(overlay, sort_keys=False))
    # `make run` then `make report` parse the workflow twice (5 s of CPU each) and start a
    # second fork server for the report's pages: their targets in one call, then the report
    shared = module_fork_servers.log  # the worker's servers (tests/conftest.py), if up
    before = shared.stat().st_size if shared.is_file() else 0
    r = snakemake(wd, "all", "report_all", "--set-threads", "pretrain=1")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert _counts(out)["finetune"] == str(5 * 2 * 2 + 3 * 2 * 2)
    own = wd / RESULTS / "logs" / "prefork.log"
    served = own.read_text() if own.is_file() else shared.read_bytes()[before:].decode()
    assert served.count(" pretrain --method ") == 5, served[-2000:]
    html = wd / RESULTS / "report.html"
    made = snakemake(wd, "--report", str(html), "report_all")
    assert made.returncode == 0, (made.stdout + made.stderr)[-4000:]
    assert html.stat().st_size > 100_000
    for page in ("finetune", "upstream", "speed", "reference"):
        assert (wd / RESULTS / "report" / f"{page}.html").is_file(), page
    ref = (wd / RESULTS / "summary" / "reference.md").read_text()
    assert ref.count("\n## `") == 10 and "(1 seed)" in ref, ref[:2000]
