"""MLflow: one run per training job, safe when many jobs start at once.

The tracking URI is `MLFLOW_TRACKING_URI` if set, else `tracking.uri` from config, else a sqlite
file in the config's results folder (`<results_dir>/mlruns.db`), so every experiment keeps its
runs beside its results (docs/experiments.md). On a cluster, point every job at a tracking server
instead (docs/cluster.md): sqlite on a network file system is unsafe.

A job killed by SIGTERM (Slurm's time limit, `scancel`, preemption) ends its run FAILED instead
of leaving it RUNNING: `start_run` turns the signal into SystemExit(143), which unwinds the job
and MLflow's context manager ends the run FAILED. A run left RUNNING by SIGKILL is ended FAILED
by the next attempt of the same job (`end_stale_runs`), or continued when the job resumes.

Concurrency, for the sqlite default: creating the schema (MLflow runs its migrations on first
use) and the experiment happens under a file lock next to the database, so parallel jobs never
race on them; sqlite writers then wait on each other through a busy timeout instead of failing
with "database is locked". For a tracking server no local lock is used (jobs run on different
nodes): the server serialises writes, and an experiment created by another job between our
lookup and our create is simply looked up again.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dpadapter.config import TrackingConfig

SQLITE_TIMEOUT_S = 60
# A saved view of the runs table with the DP columns. MLflow 3.17 opens an experiment on its GenAI
# overview and its runs table without metric or param columns (the UI keeps column choices in the
# browser); the saved view, an experiment tag in the envelope the UI's "Views" menu writes, is
# opened by `runs_url` (docs/tracking.md). Checked with headless Chromium in
# tests/cluster/test_mlflow_load.py.
DP_VIEW = "dp-runs"
_VIEW_METRICS = ("epsilon_spent", "test_accuracy", "val_accuracy", "test_robust_accuracy")
_VIEW_PARAMS = "target_epsilon delta noise_multiplier max_grad_norm sample_rate steps algorithm"
_DP_COLUMNS = [f"metrics.`{m}`" for m in _VIEW_METRICS] + [
    f"params.`{p}`" for p in (_VIEW_PARAMS + " upstream task seed").split()
]
_VIEW_STATE = {"selectedColumns": _DP_COLUMNS, "orderByKey": "attributes.start_time"}
EXPERIMENT_TAGS = {
    # MLflow 3: the experiment holds training runs (not GenAI traces).
    "mlflow.experimentKind": "custom_model_development",
    f"mlflow.sharedViewState.{DP_VIEW}": json.dumps(
        {"name": "DP runs", "createdAt": 0, "updatedAt": 0, "state": json.dumps(_VIEW_STATE)}
    ),
}


def runs_url(base: str, experiment_id: str) -> str:
    """The experiment's runs table with the DP columns (epsilon, accuracies, privacy params)."""
    return f"{base.rstrip('/')}/#/experiments/{experiment_id}/runs?viewStateShareKey={DP_VIEW}"


def resolve_uri(cfg: TrackingConfig, results_dir: str | Path | None = None) -> str:
    """The environment's URI, else the config's, else sqlite in the results folder (or cwd)."""
    uri = os.environ.get("MLFLOW_TRACKING_URI") or cfg.uri
    if not uri:
        folder = Path.cwd() if results_dir is None else Path(results_dir).resolve()
        uri = f"sqlite:///{folder / 'mlruns.db'}"
    if uri.startswith("sqlite:///") and "timeout=" not in uri:
        uri += ("&" if "?" in uri else "?") + f"timeout={SQLITE_TIMEOUT_S}"
    return uri


def _sqlite_path(uri: str) -> Path | None:
    if uri.startswith("sqlite:///"):
        return Path(uri[len("sqlite:///") :].split("?", 1)[0])
    return None


def _lock_path(uri: str) -> Path | None:
    """The lock file guarding schema and experiment creation (sqlite only)."""
    db = _sqlite_path(uri)
    return None if db is None else db.with_name(db.name + ".lock")


@contextlib.contextmanager
def _file_lock(path: Path | None) -> Iterator[None]:
    if path is None:
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _get_or_create(name: str) -> str:
    import mlflow
    from mlflow.exceptions import MlflowException

    exp = mlflow.get_experiment_by_name(name)
    if exp is not None and any(exp.tags.get(k) != v for k, v in EXPERIMENT_TAGS.items()):
        # Created before the tag existed (or by hand): open it on the runs table too.
        for k, v in EXPERIMENT_TAGS.items():
            mlflow.MlflowClient().set_experiment_tag(exp.experiment_id, k, v)
    if exp is None:
        try:
            return mlflow.create_experiment(name, tags=EXPERIMENT_TAGS)
        except MlflowException:
            # Another job (on another node, against a server) created it in between.
            exp = mlflow.get_experiment_by_name(name)
            if exp is None:
                raise
    if exp.lifecycle_stage == "deleted":
        # Deleted in the UI but still holding the name: runs cannot start in it until restored.
        mlflow.MlflowClient().restore_experiment(exp.experiment_id)
    return exp.experiment_id


def ensure_experiment(cfg: TrackingConfig, results_dir: str | Path | None = None) -> str:
    """Create the store and the experiment once (under a lock); return the experiment id."""
    import mlflow

    uri = resolve_uri(cfg, results_dir)
    mlflow.set_tracking_uri(uri)
    with _file_lock(_lock_path(uri)):
        return _get_or_create(cfg.experiment)


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        elif isinstance(v, list | tuple):
            out[key] = json.dumps(v)[:500]
        else:
            out[key] = v
    return out


class Run:
    """A thin handle so training code logs without importing mlflow itself."""

    def __init__(self, mlflow_mod, run):
        self._mlflow = mlflow_mod
        self.run = run
        self.run_id = run.info.run_id

    def log_params(self, params: dict[str, Any]) -> None:
        flat = {k: ("None" if v is None else v) for k, v in _flatten(params).items()}
        items = list(flat.items())
        for i in range(0, len(items), 100):
            self._mlflow.log_params(dict(items[i : i + 100]))

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        clean = {
            k: float(v)
            for k, v in _flatten(metrics).items()
            if isinstance(v, int | float) and not isinstance(v, bool)
        }
        if clean:
            self._mlflow.log_metrics(clean, step=step)

    def set_tags(self, tags: dict[str, Any]) -> None:
        """Tags may change on a resumed run (another node, another GPU); params may not."""
        self._mlflow.set_tags({k: str(v) for k, v in tags.items()})

    def log_artifact(self, path: str | Path) -> None:
        self._mlflow.log_artifact(str(path))

    def log_new(self, params: dict[str, Any], metrics: dict[str, float]) -> None:
        """Params and metrics this run does not hold yet (a stage may have logged them itself,
        and MLflow refuses to change a param)."""
        data = self._mlflow.get_run(self.run_id).data
        self.log_params({k: v for k, v in params.items() if k not in data.params})
        self.log_metrics({k: v for k, v in metrics.items() if k not in data.metrics})


# The columns that tell DP runs apart in the runs table, under the same names in every stage.
# Param name -> where it is found: the job's wildcards, metrics.json's `privacy` block, its
# `hyperparameters` block (first hit wins).
DP_PARAMS = {
    "target_epsilon": (("privacy", "target_epsilon"), ("wildcards", "eps")),
    "delta": (("privacy", "delta"),),
    "noise_multiplier": (("hyperparameters", "noise_multiplier"), ("privacy", "noise_multiplier")),
    "max_grad_norm": (("hyperparameters", "max_grad_norm"), ("privacy", "max_grad_norm")),
    "sample_rate": (("privacy", "sample_rate"), ("hyperparameters", "sample_rate")),
    "steps": (("privacy", "steps"),),
    "algorithm": (("hyperparameters", "algorithm"), ("wildcards", "algo")),
    "upstream": (("wildcards", "upstream"), ("hyperparameters", "upstream")),
    "task": (("wildcards", "task"), ("hyperparameters", "task")),
    "seed": (("hyperparameters", "seed"), ("wildcards", "seed")),
}
# Metrics shown as columns: epsilon_spent is the accounted epsilon of metrics.json.
DP_METRICS = {
    "epsilon_spent": ("privacy", "epsilon"),
    "test_accuracy": ("test_accuracy",),
    "val_accuracy": ("val_accuracy",),
    "test_robust_accuracy": ("test_robust_accuracy",),
    "public_test_accuracy": ("public_test_accuracy",),
    "public_test_robust_accuracy": ("public_test_robust_accuracy",),
}


def _get(d: dict, path: tuple[str, ...]) -> Any:
    for k in path:
        if not isinstance(d, dict) or d.get(k) is None:
            return None
        d = d[k]
    return d


def dp_summary(metrics: dict[str, Any]) -> tuple[dict[str, Any], dict[str, float]]:
    """(params, metrics) of DP_PARAMS / DP_METRICS found in a job's metrics.json payload."""
    params = {}
    for name, paths in DP_PARAMS.items():
        value = next((v for v in (_get(metrics, p) for p in paths) if v is not None), None)
        if value is not None:
            params[name] = value
    values = {}
    for name, path in DP_METRICS.items():
        v = _get(metrics, path)
        if isinstance(v, int | float) and not isinstance(v, bool):
            values[name] = float(v)
    return params, values


def _sigterm_to_exit(signum, frame):
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def _failed_on_sigterm() -> Iterator[None]:
    """SIGTERM unwinds the job (SystemExit), so the run is ended FAILED, not left RUNNING."""
    try:
        previous = signal.signal(signal.SIGTERM, _sigterm_to_exit)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def end_stale_runs(experiment_id: str, run_name: str, keep: str | None = None) -> list[str]:
    """End FAILED the runs of this name still RUNNING (an earlier attempt killed by SIGKILL)."""
    import mlflow

    client = mlflow.MlflowClient()
    escaped = run_name.replace("'", "\\'")
    stale = client.search_runs(
        [experiment_id],
        filter_string=f"attributes.run_name = '{escaped}' and attributes.status = 'RUNNING'",
        max_results=100,
    )
    ended = []
    for r in stale:
        if r.info.run_id != keep:
            client.set_tag(r.info.run_id, "dpadapter.ended_by", "a later attempt of the same job")
            client.set_terminated(r.info.run_id, status="FAILED")
            ended.append(r.info.run_id)
    return ended


@contextlib.contextmanager
def start_run(
    cfg: TrackingConfig,
    run_name: str,
    tags: dict[str, str],
    run_id: str | None = None,
    results_dir: str | Path | None = None,
) -> Iterator[Run]:
    """A new run, or the run of an interrupted job being resumed (its metrics continue)."""
    import mlflow

    exp_id = ensure_experiment(cfg, results_dir)
    with _failed_on_sigterm():
        if run_id is not None:
            with mlflow.start_run(run_id=run_id) as run:
                end_stale_runs(exp_id, run.info.run_name, keep=run_id)
                yield Run(mlflow, run)
            return
        end_stale_runs(exp_id, run_name)
        with mlflow.start_run(experiment_id=exp_id, run_name=run_name, tags=tags) as run:
            yield Run(mlflow, run)


def main(argv: list[str] | None = None) -> int:
    """`python -m dpadapter.tracking CONFIG [UI_BASE_URL]`: where a config's runs are.

    Prints the tracking URI (for `mlflow ui --backend-store-uri`) and the URL of the runs table
    with the DP columns (`make mlflow` starts the UI and prints it).
    """
    import argparse

    from dpadapter.config import load

    ap = argparse.ArgumentParser(prog="python -m dpadapter.tracking")
    ap.add_argument("config")
    ap.add_argument("base", nargs="?", default="http://127.0.0.1:5000")
    args = ap.parse_args(argv)
    cfg = load(args.config)
    uri = resolve_uri(cfg.tracking, cfg.results_dir)
    exp_id = ensure_experiment(cfg.tracking, cfg.results_dir)
    print(f"store: {uri.split('?', 1)[0]}")
    print(f"runs:  {runs_url(args.base, exp_id)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
