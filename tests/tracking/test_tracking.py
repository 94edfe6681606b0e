"""MLflow shows DP runs: the DP columns, readable run names and tags, one group run per stage,
per-results-dir store and artifacts, runs of killed jobs ended FAILED, experiments opened on the
training-runs table; and tracking that cannot run never stops a job (tracking.enabled)."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import snakemake_runner  # tests/ is on sys.path

from dpadapter import tracking
from dpadapter.settings import TrackingConfig
from dpadapter.stages import finetune, pretrain
from dpadapter.workflow.identity import config_hash, run_prefix

DP_PARAMS = {
    "target_epsilon", "delta", "accountant", "noise_multiplier", "max_grad_norm", "sample_rate",
    "steps", "algorithm", "strategy", "upstream", "task", "seed",
}  # fmt: skip


def tracking_enabled(cfg, enabled):
    return dataclasses.replace(cfg, tracking=dataclasses.replace(cfg.tracking, enabled=enabled))


def _client(tmp_path: Path):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlruns.db'}")


@pytest.mark.slow  # in-process, too long for `make check`
def test_system_metrics_are_sampled_into_a_run_on_request_and_on_gpu_jobs(
    tiny_cfg, tmp_path, monkeypatch
):
    """Issue 47: a user sees a starved GPU in the runs table, without a profiler. `true` samples
    the machine's use into every training job's run (MLflow's monitor: CPU, memory, and the
    GPU's with nvidia-ml-py where a GPU answers); `auto` into the runs of jobs on CUDA only,
    so none into this pre-training job's on the CPU. The fine-tuning job lasts seconds, many
    times the sampling interval (the monitor logs nothing from a job shorter than one)."""
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "0.1")
    pretrain.run(tiny_cfg, "scratch", tmp_path / "pre", None)
    on = dataclasses.replace(
        tiny_cfg, tracking=dataclasses.replace(tiny_cfg.tracking, system_metrics=True)
    )
    ckpt = tmp_path / "pre" / "model.pt"
    finetune.run(on, "scratch", "syn-shift", "dpsgd", 2.0, 0, ckpt, tmp_path / "ft")
    client = _client(tmp_path)
    exp = client.get_experiment_by_name(tiny_cfg.tracking.experiment)
    system = {
        r.data.tags["stage"]: {k for k in r.data.metrics if k.startswith("system/")}
        for r in client.search_runs([exp.experiment_id], filter_string="tags.stage != ''")
    }
    assert system["pretrain"] == set()
    want = {"system/cpu_utilization_percentage", "system/system_memory_usage_megabytes"}
    assert want <= system["finetune"], system


@pytest.mark.parametrize(
    ("setting", "on_cuda", "samples"),
    [("auto", True, True), ("auto", False, False), (True, False, True), (False, True, False)],
)
def test_system_metrics_follow_the_setting_and_the_jobs_device(setting, on_cuda, samples):
    from dpadapter.tracking.run import samples_system

    assert samples_system(TrackingConfig(system_metrics=setting), on_cuda) is samples


@pytest.mark.slow  # in-process, too long for `make check`
def test_a_strategys_job_is_its_own_run_and_folder(tiny_cfg, tmp_path):
    """A job of finetune.strategies other than finetune.strategy (`--algo dpsgd+ht`): its
    strategy is in the run's name, tags and DP columns, in its resume folder and in what it
    trained; the config's own strategy spelt as a folder is refused (its folder is plain)."""
    pretrain.run(tiny_cfg, "scratch", tmp_path / "pre", None)
    ckpt = tmp_path / "pre" / "model.pt"
    with pytest.raises(ValueError, match="finetune.strategy"):
        finetune.run(tiny_cfg, "scratch", "syn-shift", "dpsgd", 2.0, 0, ckpt, tmp_path / "x", "ft")
    m = finetune.run(tiny_cfg, "scratch", "syn-shift", "dpsgd", 2.0, 0, ckpt, tmp_path / "ft", "ht")
    assert m["wildcards"]["strategy"] == "ht" and m["hyperparameters"]["strategy"] == "ht"
    assert [p["phase"] for p in m["privacy"]["phases"]] == ["ht"]
    run = _client(tmp_path).search_runs(
        [_client(tmp_path).get_experiment_by_name(tiny_cfg.tracking.experiment).experiment_id],
        filter_string="tags.stage = 'finetune'",
    )[0]
    assert run.info.run_name == "finetune dpsgd ht scratch syn-shift ε=2 s0"
    assert run.data.tags["strategy"] == "ht" and run.data.params["strategy"] == "ht"
    wc = {"upstream": "scratch", "task": "syn-shift", "algo": "dpsgd", "eps": "2", "seed": "0"}
    assert finetune.resume_path(tiny_cfg, {**wc, "strategy": "ht"}).parts[-4] == "dpsgd+ht"
    assert finetune.resume_path(tiny_cfg, wc).parts[-4] == "dpsgd"


@pytest.mark.slow  # over ~1.5 s: make check's 2 minutes (docs/testing.md)
def test_finetune_run_has_the_dp_columns_and_the_config_identity(tiny_cfg, tmp_path):
    pretrain.run(tiny_cfg, "scratch", tmp_path / "pre", None)
    m = finetune.run(
        tiny_cfg, "scratch", "syn-shift", "dpsgd", 2.0, 0, tmp_path / "pre" / "model.pt",
        tmp_path / "ft",
    )  # fmt: skip
    client = _client(tmp_path)
    exp = client.get_experiment_by_name(tiny_cfg.tracking.experiment)
    runs = client.search_runs(
        [exp.experiment_id], filter_string="tags.stage = 'finetune'", max_results=10
    )
    assert len(runs) == 1
    run = runs[0]
    assert run.info.run_name == "finetune dpsgd scratch syn-shift ε=2 s0"
    tags = run.data.tags
    assert tags["config"] == config_hash(tiny_cfg)
    assert {k: tags[k] for k in ("stage", "upstream", "task", "algorithm", "epsilon", "seed")} == {
        "stage": "finetune", "upstream": "scratch", "task": "syn-shift", "algorithm": "dpsgd",
        "epsilon": "2", "seed": "0",
    }  # fmt: skip
    params = run.data.params
    assert DP_PARAMS <= set(params), sorted(DP_PARAMS - set(params))
    # tracking.system_metrics: auto samples jobs on CUDA only
    assert not [k for k in run.data.metrics if k.startswith("system/")]
    p = m["privacy"]
    assert float(params["target_epsilon"]) == 2.0
    assert float(params["delta"]) == p["delta"] and params["accountant"] == p["accountant"]
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
    # The run's files lie in the config's results folder, not in the working directory.
    artifacts = tmp_path / "results" / "mlartifacts"
    assert exp.artifact_location == artifacts.as_uri()
    stored = Path(run.info.artifact_uri.removeprefix("file://")) / "metrics.json"
    assert stored.is_relative_to(artifacts) and json.loads(stored.read_text()) == m
    assert not (tmp_path / "mlruns").exists()


@pytest.mark.slow  # in-process, too long for `make check`
def test_runs_of_a_stage_hang_under_one_group_run_per_config(tiny_cfg, tmp_path):
    pretrain.run(tiny_cfg, "scratch", tmp_path / "pre", None)
    for eps in (1.0, 2.0):
        finetune.run(
            tiny_cfg, "scratch", "syn-shift", "dpsgd", eps, 0, tmp_path / "pre" / "model.pt",
            tmp_path / f"ft{eps:g}",
        )  # fmt: skip
    client = _client(tmp_path)
    exp_id = client.get_experiment_by_name(tiny_cfg.tracking.experiment).experiment_id
    groups = {
        r.data.tags[tracking.GROUP_TAG]: r
        for r in client.search_runs([exp_id], filter_string=f"tags.`{tracking.GROUP_TAG}` != ''")
    }
    h = config_hash(tiny_cfg)
    assert sorted(groups) == [f"{h}/finetune", f"{h}/pretrain"]  # one per stage, not per job
    group = groups[f"{h}/finetune"]
    assert group.info.run_name == f"finetune · {run_prefix(tiny_cfg)}"
    assert group.info.status == "FINISHED"
    children = client.search_runs(
        [exp_id], filter_string=f"tags.mlflow.parentRunId = '{group.info.run_id}'"
    )
    assert sorted(r.info.run_name for r in children) == [
        "finetune dpsgd scratch syn-shift ε=1 s0", "finetune dpsgd scratch syn-shift ε=2 s0",
    ]  # fmt: skip
    (pre,) = client.search_runs([exp_id], filter_string="tags.stage = 'pretrain'")
    assert pre.data.tags["mlflow.parentRunId"] == groups[f"{h}/pretrain"].info.run_id


def test_run_names_read_as_the_job():
    assert tracking.run_name("warmup", {}) == "warmup"
    assert tracking.run_name("pretrain", {"upstream": "sam+gamma=0.5"}) == "pretrain sam+gamma=0.5"
    w = {"upstream": "standard", "task": "fmnist-same", "algo": "dpsgd", "eps": "1", "seed": "0"}
    assert tracking.run_name("finetune", w) == "finetune dpsgd standard fmnist-same ε=1 s0"
    fed = {"upstream": "scratch", "strategy": "ut", "mechanism": "gaussian", "eps": "2",
           "rounds": "4", "seed": "1"}  # fmt: skip
    assert tracking.run_name("federated", fed) == "federated gaussian ut scratch ε=2 rounds=4 s1"
    trial = {"upstream": "standard", "task": "t", "algo": "dpsgd", "seed": "0", "sweep": "1",
             "trial": "3"}  # fmt: skip
    assert tracking.run_name("hpo_trial", trial) == "hpo_trial dpsgd standard t sweep=1 trial=3 s0"


def test_default_store_lives_in_the_results_folder(monkeypatch, tmp_path):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    uri = tracking.resolve_uri(TrackingConfig(), "results-a")
    assert uri.startswith(f"sqlite:///{tmp_path / 'results-a' / 'mlruns.db'}?")
    # the variable and the config still override it
    assert tracking.resolve_uri(TrackingConfig(uri="http://h:5000"), "results-a") == "http://h:5000"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://x:1")
    assert tracking.resolve_uri(TrackingConfig(), "results-a") == "http://x:1"


@pytest.mark.slow  # over ~1.5 s: make check's 2 minutes (docs/testing.md)
def test_existing_experiment_gets_the_training_runs_view(monkeypatch, tmp_path):
    import mlflow

    uri = f"sqlite:///{tmp_path / 'mlruns.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    mlflow.set_tracking_uri(uri)
    # as made before the tag existed
    exp_id = mlflow.create_experiment("old", artifact_location=tracking.artifact_location())
    assert tracking.ensure_experiment(TrackingConfig(experiment="old")) == exp_id
    tags = mlflow.MlflowClient().get_experiment(exp_id).tags
    assert tags["mlflow.experimentKind"] == "custom_model_development"


def test_an_experiment_keeping_its_artifacts_elsewhere_is_refused(tiny_cfg, tmp_path, capsys):
    """Before, every experiment put its files in ./mlruns of wherever the job ran: such an
    experiment (or another config's) is named and refused, not silently shared."""
    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlruns.db'}")
    elsewhere = tmp_path / "mlruns"
    exp_id = mlflow.create_experiment(tiny_cfg.tracking.experiment, str(elsewhere))
    with pytest.raises(tracking.TrackingError) as err:
        tracking.ensure_experiment(tiny_cfg.tracking, tiny_cfg.results_dir)
    msg = str(err.value)
    assert str(elsewhere) in msg and str(tmp_path / "results" / "mlartifacts") in msg
    assert f"experiments rename --experiment-id {exp_id}" in msg
    # auto: the job runs untracked and says why; true: refused before training
    pretrain.run(tiny_cfg, "scratch", tmp_path / "pre", None)
    assert (tmp_path / "pre" / "metrics.json").is_file()
    assert capsys.readouterr().err.count("tracking off: MLflow experiment 'tests'") == 1
    strict = tracking_enabled(tiny_cfg, True)
    with pytest.raises(tracking.TrackingError, match="tracking.enabled is true, but MLflow exp"):
        pretrain.run(strict, "scratch", tmp_path / "pre2", None)
    assert not (tmp_path / "pre2" / "metrics.json").exists()
    assert not elsewhere.exists()


_JOB = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from dpadapter import tracking
    from dpadapter.settings import TrackingConfig
    with tracking.start_run(TrackingConfig(experiment="kill"), run_name="job", tags={}) as run:
        Path(sys.argv[1]).write_text(run.run_id)
        time.sleep(120)
    """
)


def _start_job(tmp_path: Path, env: dict, cwd: Path | None = None) -> tuple[subprocess.Popen, str]:
    marker = tmp_path / f"run-id-{time.monotonic_ns()}"
    proc = subprocess.Popen([sys.executable, "-c", _JOB, str(marker)], env=env, cwd=cwd)
    deadline = time.monotonic() + 120
    while not marker.exists():
        assert proc.poll() is None, "the job died before starting its run"
        assert time.monotonic() < deadline, "the job did not start its run"
        time.sleep(0.2)
    time.sleep(0.3)
    return proc, marker.read_text()


@pytest.mark.process
def test_killed_jobs_never_leave_a_run_running(tmp_path):
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlruns.db'}"}
    client = _client(tmp_path)
    # SIGTERM (Slurm's time limit, scancel): the job ends its run FAILED and exits 128 + 15.
    proc, run_id = _start_job(tmp_path, env)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 143
    assert client.get_run(run_id).info.status == "FAILED"
    # SIGKILL cannot be caught: the run stays RUNNING until the next run starts (any job's,
    # here another attempt), which finds its process gone and ends it KILLED.
    proc, killed = _start_job(tmp_path, env)
    proc.kill()
    proc.wait(timeout=60)
    assert client.get_run(killed).info.status == "RUNNING"
    proc, retry = _start_job(tmp_path, env)
    try:
        assert client.get_run(killed).info.status == "KILLED"
        assert client.get_run(killed).data.tags["dpadapter.ended_by"].startswith("its process")
        assert client.get_run(retry).info.status == "RUNNING"  # its process is alive
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


def test_a_run_that_ended_while_dead_runs_were_sought_keeps_its_status(tmp_path, monkeypatch):
    """A job that ends its run and exits between another job's search for RUNNING runs and its
    check of their processes looks gone; its FINISHED run must not become KILLED (seen with 8
    jobs starting at once, tests/cluster/test_mlflow_load.py)."""
    from dpadapter.tracking import lifecycle

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlruns.db'}")
    client = _client(tmp_path)
    exp = client.create_experiment("race")
    tags = {tracking.HOST_TAG: socket.gethostname(), tracking.PID_TAG: "999999999:1"}
    done, dead = (client.create_run(exp, tags=tags).info.run_id for _ in range(2))
    real = lifecycle._process_gone

    def job_ends_meanwhile(process):
        client.set_terminated(done, status="FINISHED")  # the job's own end, then its exit
        return real(process)

    monkeypatch.setattr(lifecycle, "_process_gone", job_ends_meanwhile)
    assert tracking.end_dead_runs(exp) == [dead]
    assert client.get_run(done).info.status == "FINISHED"
    assert client.get_run(dead).info.status == "KILLED"


@pytest.mark.process
def test_make_mlflow_ends_the_runs_of_killed_jobs(tmp_path, monkeypatch, tiny_raw):
    """No later run needed: opening the UI (`make mlflow`, tracking.main) ends them too."""
    import yaml

    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlruns.db'}"}
    client = _client(tmp_path)
    (tmp_path / "results").mkdir()
    # run where the config's results are: the experiment's artifacts then live there too
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(__file__).parents[2] / "src"), env.get("PYTHONPATH", "")]
    )
    proc, killed = _start_job(tmp_path, env, cwd=tmp_path / "results")
    proc.kill()
    proc.wait(timeout=60)
    assert client.get_run(killed).info.status == "RUNNING"
    tiny_raw["tracking"] = {"experiment": "kill"}
    tiny_raw["results_dir"] = str(tmp_path / "results")
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(tiny_raw))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", env["MLFLOW_TRACKING_URI"])
    assert tracking.main([str(tmp_path / "c.yaml")]) == 0
    assert client.get_run(killed).info.status == "KILLED"


# --- tracking never stops a job ------------------------------------------------------------------
_UNTRACKED_JOB = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    if sys.argv[2] == "missing":
        sys.modules["mlflow"] = None  # as on a node whose image has no MLflow
    from dpadapter.settings import from_dict
    from dpadapter.stages import finetune, pretrain
    cfg = from_dict(json.loads(Path(sys.argv[1]).read_text()))
    pretrain.run(cfg, "scratch", Path("pre"), None)
    finetune.run(cfg, "scratch", "syn-shift", "dpsgd", 2.0, 0, Path("pre/model.pt"), Path("ft"))
    print("mlflow module:", type(sys.modules.get("mlflow")).__name__)
    """
)


@pytest.mark.process
@pytest.mark.parametrize("mlflow_state,enabled", [("missing", "auto"), ("installed", False)])
def test_jobs_run_untracked_without_mlflow_or_with_tracking_off(
    tiny_raw, tmp_path, mlflow_state, enabled
):
    """Two jobs in one process: both write their results; a missing MLflow is said once, and
    `enabled: false` never imports it."""
    tiny_raw["tracking"]["enabled"] = enabled
    (tmp_path / "config.json").write_text(json.dumps(tiny_raw))
    r = subprocess.run(
        [sys.executable, "-c", _UNTRACKED_JOB, "config.json", mlflow_state],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
        env={**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlruns.db'}"},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    for job in ("pre", "ft"):
        assert (tmp_path / job / "metrics.json").is_file()
    assert json.loads((tmp_path / "ft" / "metrics.json").read_text())["privacy"]["epsilon"] <= 2
    assert "mlflow module: NoneType" in r.stdout  # never imported (or importable)
    said = [line for line in r.stderr.splitlines() if line.startswith("tracking off:")]
    if enabled == "auto":
        assert len(said) == 1 and "mlflow cannot be imported" in said[0], r.stderr[-3000:]
    else:
        assert said == []
    assert (
        not (tmp_path / "mlruns.db").exists()
        and not (tmp_path / "results" / "mlartifacts").exists()
    )


def _closed_port_uri() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"  # nothing listens there any more


@pytest.mark.slow  # over ~1.5 s: make check's 2 minutes (docs/testing.md)
def test_an_unreachable_server_is_skipped_under_auto_and_refused_under_true(
    tiny_cfg, tmp_path, monkeypatch, capsys
):
    uri = _closed_port_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setattr(tracking.store, "PROBE_TIMEOUT_S", 2.0)
    pretrain.run(tiny_cfg, "scratch", tmp_path / "pre", None)
    finetune.run(
        tiny_cfg, "scratch", "syn-shift", "dpsgd", 2.0, 0, tmp_path / "pre" / "model.pt",
        tmp_path / "ft",
    )  # fmt: skip
    assert (tmp_path / "ft" / "metrics.json").is_file()
    said = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("tracking off:")]
    assert len(said) == 1 and f"the tracking server {uri} does not answer" in said[0]

    strict = tracking_enabled(tiny_cfg, True)
    with pytest.raises(
        tracking.TrackingError, match=f"tracking.enabled is true, but the tracking server {uri}"
    ):
        tracking.check(strict)  # the workflow's onstart: before any job
    with pytest.raises(tracking.TrackingError, match="does not answer"):
        finetune.run(
            strict, "scratch", "syn-shift", "dpsgd", 2.0, 0, tmp_path / "pre" / "model.pt",
            tmp_path / "ft-strict",
        )  # fmt: skip
    assert not (tmp_path / "ft-strict" / "metrics.json").exists()
    assert not tracking.resolve_uri(strict.tracking).startswith("sqlite")


def test_required_tracking_without_mlflow_is_refused_before_any_job(tiny_cfg, monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)
    with pytest.raises(tracking.TrackingError, match="but mlflow cannot be imported"):
        tracking.check(tracking_enabled(tiny_cfg, True))
    tracking.check(tiny_cfg)  # auto: nothing to refuse (each job says it once)


@pytest.mark.slow  # in-process, too long for `make check`
def test_a_store_failing_during_a_job_stops_tracking_not_the_job(
    tiny_cfg, tmp_path, monkeypatch, capsys
):
    import mlflow

    def broken(*args, **kwargs):
        raise OSError("disk full")

    pretrain.run(tiny_cfg, "scratch", tmp_path / "pre", None)
    monkeypatch.setattr(mlflow, "log_metrics", broken)
    m = finetune.run(
        tiny_cfg, "scratch", "syn-shift", "dpsgd", 2.0, 0, tmp_path / "pre" / "model.pt",
        tmp_path / "ft",
    )  # fmt: skip
    assert (tmp_path / "ft" / "metrics.json").is_file() and m["privacy"]["epsilon"] <= 2
    said = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("tracking off:")]
    assert len(said) == 1 and "disk full" in said[0]
    # the run was ended, not left RUNNING
    client = _client(tmp_path)
    (run,) = client.search_runs(
        [client.get_experiment_by_name("tests").experiment_id],
        filter_string="tags.stage = 'finetune'",
    )
    assert run.info.status == "FINISHED"
    with pytest.raises(OSError, match="disk full"):
        finetune.run(
            tracking_enabled(tiny_cfg, True), "scratch", "syn-shift", "dpsgd", 4.0, 0,
            tmp_path / "pre" / "model.pt", tmp_path / "ft-strict",
        )  # fmt: skip


def test_the_dp_view_shows_epsilon_spent_beside_its_target_delta_and_accountant():
    """Issue 50, item 1: the runs table a reader opens shows the ε each run spent, with the
    δ and the accountant it is an ε of."""
    views = {
        k: json.loads(json.loads(v)["state"])
        for k, v in tracking.naming.EXPERIMENT_TAGS.items()
        if k.startswith("mlflow.sharedViewState.")
    }
    columns = views[f"mlflow.sharedViewState.{tracking.naming.DP_VIEW}"]["selectedColumns"]
    assert columns[0] == "metrics.`epsilon_spent`"
    for p in ("target_epsilon", "delta", "accountant"):
        assert f"params.`{p}`" in columns, columns
    payload = {"privacy": {"epsilon": 0.99, "delta": 1e-5, "accountant": "rdp"}}
    params, metrics = tracking.naming.dp_summary(payload)
    assert params == {"delta": 1e-5, "accountant": "rdp"} and metrics == {"epsilon_spent": 0.99}


@pytest.mark.slow  # in-process, too long for `make check`
def test_the_runs_url_opens_the_configs_experiment_in_the_dp_view(
    tiny_raw, tmp_path, monkeypatch, capsys
):
    """What `make mlflow` opens (without starting the UI): this config's store and experiment."""
    import yaml

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    tiny_raw["results_dir"] = "res-a"
    (tmp_path / "a.yaml").write_text(yaml.safe_dump(tiny_raw))
    assert tracking.main(["a.yaml", "--port", "5123"]) == 0
    out = capsys.readouterr().out
    assert f"store: sqlite:///{tmp_path / 'res-a' / 'mlruns.db'}" in out
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'res-a' / 'mlruns.db'}")
    exp_id = client.get_experiment_by_name("tests").experiment_id
    assert (
        f"runs:  http://127.0.0.1:5123/#/experiments/{exp_id}/runs?viewStateShareKey=dp-runs" in out
    )
    # a server: its own URL, and one that does not answer is said at once
    uri = _closed_port_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    assert tracking.main(["a.yaml", "--serve"]) == 2
    assert f"error: the tracking server {uri} does not answer" in capsys.readouterr().err


@pytest.mark.slow
def test_the_workflow_refuses_required_tracking_before_any_job(tiny_raw, tmp_path):
    import yaml

    tiny_raw["tracking"]["enabled"] = True
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(tiny_raw))
    repo = Path(__file__).resolve().parents[2]
    uri = _closed_port_uri()
    r = snakemake_runner.run(
        [sys.executable, "-m", "snakemake", "--snakefile", str(repo / "Snakefile"),
         "--directory", str(tmp_path), "--cores", "1", "results/warmup/model.pt"],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "MLFLOW_TRACKING_URI": uri},
    )  # fmt: skip
    assert r.returncode != 0
    assert f"tracking.enabled is true, but the tracking server {uri} does not answer" in r.stderr
    assert not (tmp_path / "results" / "logs").exists()  # no job started


@pytest.mark.process
def test_a_job_refused_for_required_tracking_says_why_in_one_line(tiny_raw, tmp_path):
    """`python -m dpadapter ...` by hand: exit 2 and the reason, not a traceback."""
    import yaml

    tiny_raw["tracking"]["enabled"] = True
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(tiny_raw))
    uri = _closed_port_uri()
    r = subprocess.run(
        [sys.executable, "-m", "dpadapter", "--config", "config.yaml", "warmup", "--out", "w"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env={**os.environ, "MLFLOW_TRACKING_URI": uri},
    )  # fmt: skip
    assert r.returncode == 2, r.stderr[-2000:]
    assert f"error: tracking.enabled is true, but the tracking server {uri}" in r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "w" / "model.pt").exists()
