"""A job run without the prefork server (a cluster job, `DPADAPTER_PREFORK=0`) is watched by a
light parent: a SIGKILL nobody sent (the OOM killer) is explained and exits 137, its MLflow run
(which records the child, the process that died) is ended KILLED by the next run, a signal to
the job's process reaches the training child once, and a killed parent takes its child along."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from proc_helpers import children
from tiny_config import TINY_RAW

from dpadapter import tracking
from dpadapter.tracking import run as tracking_run


def _start(tmp_path: Path, name: str, tracked: bool) -> tuple[subprocess.Popen, Path]:
    """A warm-up of minutes (surely still running when signalled) in its own process."""
    raw = {**TINY_RAW, "tracking": {"experiment": "supervised"} if tracked else {"enabled": False}}
    raw["finetune"] = {**raw["finetune"], "grad_sample_mode": "hooks", "physical_batch_size": 25}
    raw["warmup"] = {**raw["warmup"], "epochs": 500}
    cfg = tmp_path / f"{name}.json"
    cfg.write_text(json.dumps(raw))
    err = tmp_path / f"{name}.err"
    env = {**os.environ, "DPADAPTER_PREFORK": "0", "DPADAPTER_THREADS": "1"}
    env.pop("DPADAPTER_SUPERVISE", None)
    with open(err, "w") as stderr:
        p = subprocess.Popen(
            [sys.executable, "-m", "dpadapter", "--config", str(cfg), "warmup"]
            + ["--out", str(tmp_path / name)],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )
    return p, err


def _child(p: subprocess.Popen) -> int:
    deadline = time.monotonic() + 60
    while not (kids := children(p.pid)):
        assert p.poll() is None and time.monotonic() < deadline, "no child runs the job"
        time.sleep(0.02)
    return kids[0]


def _training(p: subprocess.Popen, err: Path) -> None:
    """Wait until the job trains: its MLflow run has started by then."""
    deadline = time.monotonic() + 180
    while "[warmup] epoch 1/" not in err.read_text():
        assert p.poll() is None and time.monotonic() < deadline, err.read_text()
        time.sleep(0.1)


@pytest.mark.process
def test_a_job_killed_for_memory_without_a_server_says_so_and_its_run_ends(tmp_path):
    from mlflow import MlflowClient

    client = MlflowClient()  # the test's own store (conftest: MLFLOW_TRACKING_URI)
    p, err = _start(tmp_path, "killed", tracked=True)
    child = _child(p)
    _training(p, err)
    (run,) = client.search_runs(
        [client.get_experiment_by_name("supervised").experiment_id],
        filter_string="attributes.status = 'RUNNING' and tags.`dpadapter.job` != ''",
    )
    # the run records the process that trains, the one that dies
    assert run.data.tags[tracking.PID_TAG].split(":")[0] == str(child)
    os.kill(child, signal.SIGKILL)  # as the kernel's out-of-memory killer does
    assert p.wait(timeout=60) == 128 + signal.SIGKILL
    text = err.read_text()
    assert "warmup was killed by SIGKILL" in text and "out-of-memory" in text, text
    assert "grad_sample_mode: hooks" in text and "physical_batch_size: 25" in text, text
    assert tracking.end_dead_runs(run.info.experiment_id) == [run.info.run_id]
    assert client.get_run(run.info.run_id).info.status == "KILLED"


@pytest.mark.process
def test_a_signal_to_the_job_reaches_its_child_and_a_killed_parent_takes_it_along(tmp_path):
    from mlflow import MlflowClient

    p, err = _start(tmp_path, "terminated", tracked=True)
    _child(p)
    _training(p, err)
    p.send_signal(signal.SIGTERM)  # Slurm's time limit, scancel: to the job's process
    assert p.wait(timeout=60) == 128 + signal.SIGTERM
    text = err.read_text()
    assert "killed by SIGKILL" not in text, text
    # the child unwound on SIGTERM and ended its run FAILED: the parent cannot end a run
    client = MlflowClient()
    exp = client.get_experiment_by_name("supervised").experiment_id
    (run,) = client.search_runs([exp], filter_string="tags.`dpadapter.job` != ''")
    assert run.info.status == "FAILED"
    assert not (tmp_path / "terminated" / "model.pt").exists()

    p, _ = _start(tmp_path, "orphan", tracked=False)
    child = _child(p)
    p.kill()
    p.wait(timeout=60)
    deadline = time.monotonic() + 30
    while Path(f"/proc/{child}").exists() and "Z" not in _state(child):
        assert time.monotonic() < deadline, f"the job's child {child} outlived its parent"
        time.sleep(0.05)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


def test_a_second_sigterm_does_not_cut_the_unwinding_short():
    """Under Slurm the training child gets SIGTERM from Slurm and from its parent: the first
    unwinds the job (SystemExit 143), the second must not interrupt the run's ending."""
    before = signal.getsignal(signal.SIGTERM)
    with tracking_run._failed_on_sigterm():
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
            raise AssertionError("SIGTERM did not unwind the job")
        except SystemExit as exc:
            assert exc.code == 143
            os.kill(os.getpid(), signal.SIGTERM)  # ignored while unwinding
            time.sleep(0.05)
    assert signal.getsignal(signal.SIGTERM) == before
