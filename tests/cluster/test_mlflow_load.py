"""MLflow under load: 8 jobs (processes) start at the same instant against one fresh sqlite store.

The 8 are forked from one process that imported MLflow, as the pipeline forks its jobs from a
fork server; each opens the store itself, after the fork.

They race on creating the schema, the experiment and their runs; dpadapter.tracking must make
all 8 land, with every metric. The store is then served over HTTP on 127.0.0.1 only, read back
through the REST API, and the runs page is rendered by headless Chromium (DOM and screenshot).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from cluster_helpers import (
    VENV_BIN,
    free_port,
    require_debian_packages,
    run_in_session,
    start_daemon,
    stop_daemon,
    wait_until,
)

pytestmark = pytest.mark.process

N_JOBS = 8
STEPS = 5
EXPERIMENT = "load"
WORKER = Path(__file__).with_name("mlflow_worker.py")


def _race(wd: Path, n_jobs: int, *extra: str) -> Path:
    """n_jobs workers released at one instant against one fresh sqlite store in wd; asserts
    they all succeeded. They are processes forked from one that imported MLflow once, as the
    pipeline's jobs are forked from its fork server (`dpadapter.launch.prefork`)."""
    db = wd / "mlruns.db"
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{db}"}
    barrier = wd / "barrier"
    barrier.mkdir()
    launcher = subprocess.Popen(
        [sys.executable, str(WORKER), str(n_jobs), EXPERIMENT, str(barrier), str(STEPS), *extra],
        cwd=wd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    # Release all workers at once, once each is forked and waiting.
    ready = lambda: sum((barrier / f"ready-{i}").exists() for i in range(n_jobs)) == n_jobs  # noqa: E731
    try:
        wait_until(lambda: ready() or launcher.poll() is not None, 300, "workers ready")
    finally:
        (barrier / "go").touch()
    out = launcher.communicate(timeout=300)[0]
    status = dict(re.findall(r"^worker (\d+) rc (-?\d+)$", out, re.M))
    assert sorted(map(int, status)) == list(range(n_jobs)), out[-3000:]
    failed = [
        (i, (barrier / f"out-{i}.txt").read_text()[-2000:])
        for i in range(n_jobs)
        if status[str(i)] != "0"
    ]
    assert not failed, f"{len(failed)} of {n_jobs} jobs failed; first: {failed[0]}"
    assert launcher.returncode == 0, out[-3000:]
    return db


@pytest.fixture(scope="module")
def loaded_store(tmp_path_factory) -> Path:
    """A sqlite store written by N_JOBS concurrent processes; asserts they all succeeded."""
    return _race(tmp_path_factory.mktemp("mlflow-load"), N_JOBS)


def test_concurrent_jobs_of_a_grid_make_one_group_run(tmp_path):
    """Every job looks its group run up and creates it when missing: at one instant, one."""
    from mlflow import MlflowClient

    from dpadapter.tracking import GROUP_TAG

    n = 4
    db = _race(tmp_path, n, "grid")
    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    runs = client.search_runs([client.get_experiment_by_name(EXPERIMENT).experiment_id])
    groups = [r for r in runs if GROUP_TAG in r.data.tags]
    assert len(groups) == 1, [g.info.run_id for g in groups]
    children = [r for r in runs if GROUP_TAG not in r.data.tags]
    assert len(children) == n
    assert {r.data.tags["mlflow.parentRunId"] for r in children} == {groups[0].info.run_id}


def test_concurrent_jobs_all_land_in_sqlite(loaded_store):
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{loaded_store}")
    exps = [e for e in client.search_experiments() if e.name == EXPERIMENT]
    assert len(exps) == 1, "the experiment was created exactly once"
    runs = client.search_runs([exps[0].experiment_id], max_results=100)
    assert sorted(r.info.run_name for r in runs) == sorted(f"load/{i}" for i in range(N_JOBS))
    for r in runs:
        assert r.info.status == "FINISHED"
        i = int(r.data.tags["wildcard.worker"])
        assert r.data.params["worker"] == str(i)
        history = client.get_metric_history(r.info.run_id, "loss")
        assert [m.step for m in sorted(history, key=lambda m: m.step)] == list(range(1, STEPS + 1))
        assert r.data.metrics["test_accuracy"] == pytest.approx(i / 10)
        assert r.data.metrics["epsilon_spent"] == pytest.approx(0.1 * STEPS)
    # the lock file sits next to the database, not in the working directory
    assert loaded_store.with_name("mlruns.db.lock").exists()


def _post_json(url: str, payload: dict) -> dict:
    req = urllib.request.Request(
        url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status == 200
    except OSError:
        return False


@pytest.fixture(scope="module")
def mlflow_server(loaded_store, tmp_path_factory):
    """`mlflow server` on a free 127.0.0.1 port over the loaded store; stopped by PID after."""
    port = free_port()
    log = tmp_path_factory.mktemp("mlflow-server") / "server.log"
    cmd = [
        str(VENV_BIN / "mlflow"), "server",
        "--backend-store-uri", f"sqlite:///{loaded_store}",
        "--default-artifact-root", str(loaded_store.parent / "mlartifacts"),
        "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
    ]  # fmt: skip
    proc = start_daemon(cmd, log, cwd=loaded_store.parent)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until(
            lambda: proc.poll() is not None or _healthy(f"{base}/health"),
            180,
            "mlflow server",
            log=log,
        )
        assert proc.poll() is None, log.read_text()[-3000:]
        yield base
    finally:
        stop_daemon(proc)


def test_server_serves_the_runs_over_http(mlflow_server):
    exp = _post_json(f"{mlflow_server}/api/2.0/mlflow/experiments/search", {"max_results": 100})
    exp_id = next(e["experiment_id"] for e in exp["experiments"] if e["name"] == EXPERIMENT)
    runs = _post_json(
        f"{mlflow_server}/api/2.0/mlflow/runs/search",
        {"experiment_ids": [exp_id], "max_results": 100},
    )["runs"]
    assert sorted(r["info"]["run_name"] for r in runs) == sorted(f"load/{i}" for i in range(N_JOBS))
    assert all(r["info"]["status"] == "FINISHED" for r in runs)


def test_chromium_renders_the_runs_page(mlflow_server, tmp_path):
    require_debian_packages(["chromium"], ["chromium"])
    exp = _post_json(f"{mlflow_server}/api/2.0/mlflow/experiments/search", {"max_results": 100})
    exp_id = next(e["experiment_id"] for e in exp["experiments"] if e["name"] == EXPERIMENT)
    # The URL the docs give: the runs table in the saved view with the DP columns.
    from dpadapter.tracking import runs_url

    url = runs_url(mlflow_server, exp_id)
    png = tmp_path / "mlflow-runs.png"
    cmd = [
        shutil.which("chromium"), "--headless", "--no-sandbox", "--disable-gpu",
        "--disable-background-networking", "--disable-component-update", "--no-first-run",
        "--disable-dev-shm-usage", f"--user-data-dir={tmp_path / 'chromium-profile'}",
        "--window-size=1600,1000", "--virtual-time-budget=20000",
        f"--screenshot={png}", "--dump-dom", url,
    ]  # fmt: skip
    rc, out, err = run_in_session(cmd, timeout_s=240)
    assert rc == 0 and png.is_file(), err[-2000:]

    # What the page shows once its JavaScript has run: every run name, in the runs table ...
    missing = [f"load/{i}" for i in range(N_JOBS) if f">load/{i}<" not in out]
    assert not missing, f"runs page lacks {missing}"
    assert "matching runs" in out
    # ... with the columns of a DP run: epsilon spent, accuracy, target epsilon and sigma
    # (MLflow 3.17 shows none of them by default), and their values for every run.
    for column in ("epsilon_spent", "test_accuracy", "target_epsilon", "noise_multiplier"):
        assert f">{column}<" in out, f"runs table lacks the column {column}"
    cell = r'role="gridcell" col-id="metrics.`test_accuracy`"[^>]*>(?:<[^>]*>)*([^<]*)<'
    shown = sorted(float(v) for v in re.findall(cell, out))
    assert shown == pytest.approx([i / 10 for i in range(N_JOBS)]), shown
    # ... and the screenshot of it is a rendered page, not a blank one.
    from PIL import Image

    with Image.open(png) as img:
        assert img.size == (1600, 1000)
        colours = img.convert("RGB").getcolors(maxcolors=1 << 20)
    assert colours is not None and len(colours) > 50, "the screenshot is (nearly) blank"
    print(f"screenshot: {png}")
