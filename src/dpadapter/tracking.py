"""MLflow: one run per training job, safe when many jobs start at once.

The tracking URI is `MLFLOW_TRACKING_URI` if set, else `tracking.uri` from config, else a sqlite
file in the working directory (the project root under Snakemake). On a cluster, point every job
at a tracking server instead (README, "On a cluster"): sqlite on a network file system is unsafe.

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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dpadapter.config import TrackingConfig

SQLITE_TIMEOUT_S = 60
# MLflow 3 opens an experiment on its GenAI overview unless told it holds training runs.
EXPERIMENT_TAGS = {"mlflow.experimentKind": "custom_model_development"}


def resolve_uri(cfg: TrackingConfig) -> str:
    uri = os.environ.get("MLFLOW_TRACKING_URI") or cfg.uri
    if not uri:
        uri = f"sqlite:///{Path.cwd() / 'mlruns.db'}"
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


def ensure_experiment(cfg: TrackingConfig) -> str:
    """Create the store and the experiment once (under a lock); return the experiment id."""
    import mlflow

    uri = resolve_uri(cfg)
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

    def log_artifact(self, path: str | Path) -> None:
        self._mlflow.log_artifact(str(path))


@contextlib.contextmanager
def start_run(
    cfg: TrackingConfig, run_name: str, tags: dict[str, str], run_id: str | None = None
) -> Iterator[Run]:
    """A new run, or the run of an interrupted job being resumed (its metrics continue)."""
    import mlflow

    exp_id = ensure_experiment(cfg)
    if run_id is not None:
        with mlflow.start_run(run_id=run_id) as run:
            yield Run(mlflow, run)
        return
    with mlflow.start_run(experiment_id=exp_id, run_name=run_name, tags=tags) as run:
        yield Run(mlflow, run)
