"""MLflow shows DP runs: the DP columns, config identity in run names, per-results-dir store,
runs of killed jobs ended FAILED, experiments opened on the training-runs table."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from dpadapter import tracking
from dpadapter.config import TrackingConfig
from dpadapter.identity import config_hash, run_prefix
from dpadapter.stages import finetune, pretrain

DP_PARAMS = {
    "target_epsilon", "delta", "noise_multiplier", "max_grad_norm", "sample_rate", "steps",
    "algorithm", "upstream", "task", "seed",
}  # fmt: skip


def _client(tmp_path: Path):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlruns.db'}")


def test_finetune_run_has_the_dp_columns_and_the_config_identity(tiny_cfg, tmp_path):
    pretrain.run(tiny_cfg, "scratch", tmp_path / "pre", None)
    m = finetune.run(
        tiny_cfg, "scratch", "syn-shift", "dpsgd", 2.0, 0, tmp_path / "pre" / "model.pt",
        tmp_path / "ft",
    )  # fmt: skip
    client = _client(tmp_path)
    exp = client.get_experiment_by_name(tiny_cfg.tracking.experiment)
    runs = client.search_runs(
        [exp.experiment_id], filter_string="tags.rule = 'finetune'", max_results=10
    )
    assert len(runs) == 1
    run = runs[0]
    assert run.info.run_name == f"{run_prefix(tiny_cfg)} finetune/scratch/syn-shift/dpsgd/2/0"
    assert run.data.tags["config"] == config_hash(tiny_cfg)
    params = run.data.params
    assert DP_PARAMS <= set(params), sorted(DP_PARAMS - set(params))
    p = m["privacy"]
    assert float(params["target_epsilon"]) == 2.0
    assert float(params["delta"]) == p["delta"]
    assert float(params["sample_rate"]) == pytest.approx(
        tiny_cfg.finetune.batch_size / m["hyperparameters"]["n_train"]
    )
    assert int(params["steps"]) == p["steps"]
    assert float(params["noise_multiplier"]) == pytest.approx(
        m["hyperparameters"]["noise_multiplier"]
    )
    assert (params["algorithm"], params["upstream"], params["task"], params["seed"]) == (
        "dpsgd", "scratch", "syn-shift", "0",
    )  # fmt: skip
    metrics = run.data.metrics
    assert metrics["epsilon_spent"] == pytest.approx(p["epsilon"])
    assert metrics["test_accuracy"] == pytest.approx(m["test_accuracy"])
    assert "val_accuracy" in metrics and "test_robust_accuracy" in metrics


def test_default_store_lives_in_the_results_folder(monkeypatch, tmp_path):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    uri = tracking.resolve_uri(TrackingConfig(), "results-a")
    assert uri.startswith(f"sqlite:///{tmp_path / 'results-a' / 'mlruns.db'}?")
    # the variable and the config still override it
    assert tracking.resolve_uri(TrackingConfig(uri="http://h:5000"), "results-a") == "http://h:5000"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://x:1")
    assert tracking.resolve_uri(TrackingConfig(), "results-a") == "http://x:1"


def test_existing_experiment_gets_the_training_runs_view(monkeypatch, tmp_path):
    import mlflow

    uri = f"sqlite:///{tmp_path / 'mlruns.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    mlflow.set_tracking_uri(uri)
    exp_id = mlflow.create_experiment("old")  # as made before the tag existed
    assert tracking.ensure_experiment(TrackingConfig(experiment="old")) == exp_id
    tags = mlflow.MlflowClient().get_experiment(exp_id).tags
    assert tags["mlflow.experimentKind"] == "custom_model_development"


_JOB = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from dpadapter import tracking
    from dpadapter.config import TrackingConfig
    with tracking.start_run(TrackingConfig(experiment="kill"), run_name="job", tags={}) as run:
        Path(sys.argv[1]).write_text(run.run_id)
        time.sleep(120)
    """
)


def _start_job(tmp_path: Path, env: dict) -> tuple[subprocess.Popen, str]:
    marker = tmp_path / f"run-id-{time.monotonic_ns()}"
    proc = subprocess.Popen([sys.executable, "-c", _JOB, str(marker)], env=env)
    deadline = time.monotonic() + 120
    while not marker.exists():
        assert proc.poll() is None, "the job died before starting its run"
        assert time.monotonic() < deadline, "the job did not start its run"
        time.sleep(0.2)
    time.sleep(0.3)
    return proc, marker.read_text()


def test_killed_jobs_never_leave_a_run_running(tmp_path):
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlruns.db'}"}
    client = _client(tmp_path)
    # SIGTERM (Slurm's time limit, scancel): the job ends its run FAILED and exits 128 + 15.
    proc, run_id = _start_job(tmp_path, env)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 143
    assert client.get_run(run_id).info.status == "FAILED"
    # SIGKILL cannot be caught: the run stays RUNNING until the next attempt of the job ends it.
    proc, killed = _start_job(tmp_path, env)
    proc.kill()
    proc.wait(timeout=60)
    assert client.get_run(killed).info.status == "RUNNING"
    proc, retry = _start_job(tmp_path, env)
    try:
        assert client.get_run(killed).info.status == "FAILED"
        assert client.get_run(retry).info.status == "RUNNING"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
