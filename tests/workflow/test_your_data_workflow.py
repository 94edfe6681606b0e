"""A researcher's own image folder through Snakemake (docs/your-data.md): bad files refused by a
dry run before any job; an in-place edit reruns exactly the jobs of the task that reads it, and
says why; a rerun that fails leaves the previous results in place."""

from __future__ import annotations

import copy
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import snakemake_runner  # tests/ is on sys.path
import yaml
from PIL import Image
from tiny_config import TINY_RAW

from dpadapter.workflow.identity import OVERWRITE_ENV

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow

# A job started with this set exits at once (`_CRASH`): a failure injected after validation.
CRASH_ENV = "DPADAPTER_TEST_CRASH"
_CRASH = f"""import os, sys
if os.environ.get("{CRASH_ENV}") and sys.orig_argv[1:3] == ["-m", "dpadapter"]:
    raise SystemExit("crashed on purpose by the test")
"""


def _digits(base: Path, per_class=20, test=6, classes=3) -> None:
    from sklearn.datasets import load_digits

    d = load_digits()
    for c in range(classes):
        for i, img in enumerate(d.images[d.target == c][: per_class + test]):
            p = base / ("train" if i < per_class else "test") / str(c) / f"{i}.png"
            p.parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray((img * 255 / 16).astype(np.uint8), "L").save(p)


def _config(wd: Path) -> Path:
    raw = copy.deepcopy(TINY_RAW)
    raw["data"]["root"] = str(wd / "data")
    mine = {"dataset": "imagefolder:digits@16", "n_train": 50, "n_val": 10, "n_test": 18}
    raw["tasks"] = {"mine": mine, "syn-same": raw["tasks"]["syn-same"]}
    raw["privacy"]["delta"] = 0.01
    raw["finetune"]["epsilons"] = [1]
    raw["finetune"]["epochs"] = 1
    raw["finetune"]["batch_size"] = 10
    _digits(wd / "data" / "digits")
    (wd / "config.yaml").write_text(yaml.safe_dump(raw))
    return wd / "data" / "digits"


def _snakemake(wd: Path, *args: str, **extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", OVERWRITE_ENV)}
    env.update({"DPADAPTER_PREFORK": "0", **extra})
    cmd = [sys.executable, "-m", "snakemake", "--snakefile", str(REPO / "Snakefile"),
           "--directory", str(wd), "--cores", "1", *args]  # fmt: skip
    return snakemake_runner.run(cmd, capture_output=True, text=True, env=env, timeout=900)


JOBS = [f"results/finetune/scratch/{t}/dpsgd/eps1/seed0/metrics.json" for t in ("mine", "syn-same")]


def _planned(r: subprocess.CompletedProcess) -> list[str]:
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    return sorted(set(re.findall(r"output: (results/\S+?\.json)", r.stdout + r.stderr)))


def test_bad_files_are_refused_by_a_dry_run_naming_them(tmp_path):
    base = _config(tmp_path)
    corrupt = base / "train" / "1" / "3.png"
    corrupt.write_bytes(b"\x89PNG not really")
    stray = base / "test" / "2" / "labels.csv"
    stray.write_text("a,b")
    leaked = base / "test" / "0" / "from-train.png"
    shutil.copy(base / "train" / "0" / "5.png", leaked)
    (base / "test" / "9").mkdir()
    val_leak = base / "val" / "1" / "from-test.png"  # val/ beside test/: the validation split
    val_leak.parent.mkdir(parents=True)
    shutil.copy(base / "test" / "1" / "21.png", val_leak)
    r = _snakemake(tmp_path, "-n", *JOBS)
    out = r.stdout + r.stderr
    assert r.returncode != 0
    for needle in (
        f"{corrupt}: ",
        "cannot be decoded; replace or remove them",
        f"{stray}; move them out of the class folders",
        f"{base / 'train' / '0' / '5.png'} = {leaked}",
        "class folders without images: 9",
        f"{base / 'test' / '1' / '21.png'} = {val_leak}",
        "tasks.mine.dataset",
    ):
        assert needle in out, out[-3000:]
    assert "Traceback" not in out and not (tmp_path / "results").exists()
    assert "no config file writes" not in out  # no line of the list read as a config key


def test_a_validation_folder_is_read_and_n_val_against_it_is_refused_by_a_dry_run(tmp_path):
    base = _config(tmp_path)  # n_val: 10
    for c in range(3):
        (base / "val" / str(c)).mkdir(parents=True)
        Image.new("L", (8, 8), 100 + c).save(base / "val" / str(c) / "v.png")
    r = _snakemake(tmp_path, "-n", *JOBS)
    out = r.stdout + r.stderr
    assert r.returncode != 0 and "tasks.mine.n_val: 10" in out and "set it to 3" in out, out
    assert "Traceback" not in out and not (tmp_path / "results").exists()
    cfg = yaml.safe_load((tmp_path / "config.yaml").read_text())
    del cfg["tasks"]["mine"]["n_val"]
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg))
    assert _planned(_snakemake(tmp_path, "-n", *JOBS)) == sorted(JOBS)


def test_an_edit_reruns_exactly_its_tasks_jobs_and_a_failed_rerun_keeps_the_results(tmp_path):
    base = _config(tmp_path)
    r = _snakemake(tmp_path, *JOBS)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert "Nothing to be done" in _snakemake(tmp_path, "-n", *JOBS).stdout
    # an unchanged folder re-checked, a file touched: nothing reruns
    (base / "train" / "2" / "0.png").touch()
    assert "Nothing to be done" in _snakemake(tmp_path, "-n", *JOBS).stdout

    edited = base / "train" / "2" / "4.png"
    Image.new("L", (8, 8), 200).save(edited)  # in place, same name
    r = _snakemake(tmp_path, "-n", *JOBS)
    assert _planned(r) == [JOBS[0]], r.stdout[-3000:]
    assert "the data changed since the last run" in r.stderr and "imagefolder:digits@16" in r.stderr
    assert "Params have changed" in r.stdout
    r = _snakemake(tmp_path, "--list-changes", "params", *JOBS)
    assert JOBS[0] in r.stdout.split(), r.stdout[-2000:]

    # the rerun fails: the previous results are still there, and still due to rerun
    out = tmp_path / JOBS[0]
    before = {p.name: p.read_bytes() for p in out.parent.iterdir()}
    crash = tmp_path / "crash"
    crash.mkdir()
    (crash / "sitecustomize.py").write_text(_CRASH)
    path = os.pathsep.join([str(crash), os.environ.get("PYTHONPATH", "")])
    r = _snakemake(tmp_path, *JOBS, **{CRASH_ENV: "1", "PYTHONPATH": path})
    assert (
        r.returncode != 0
        and "crashed on purpose"
        in (tmp_path / "results/logs")
        .joinpath("finetune/scratch/mine/dpsgd/eps1/seed0.log")
        .read_text()
    )
    assert {p.name: p.read_bytes() for p in out.parent.iterdir()} == before
    assert "previous outputs of the failed jobs are back" in r.stderr
    assert not (tmp_path / "results" / ".kept").exists()
    assert _planned(_snakemake(tmp_path, "-n", *JOBS)) == [JOBS[0]]
    # and a rerun that succeeds replaces them
    r = _snakemake(tmp_path, *JOBS)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert out.read_bytes() != before[out.name]
    assert "Nothing to be done" in _snakemake(tmp_path, "-n", *JOBS).stdout
