"""Where the runs go, and whether tracking is on: the store, its lock, the experiment.

The tracking URI is `MLFLOW_TRACKING_URI` if set, else `tracking.uri` from config, else a sqlite
file in the config's results folder (`<results_dir>/mlruns.db`), so every experiment keeps its
runs beside its results (docs/experiments.md). On a cluster, point every job at a tracking server
instead (docs/cluster.md): sqlite on a network file system is unsafe.

Concurrency, for the sqlite default: creating the schema (MLflow runs its migrations on first
use) and the experiment happens under a file lock next to the database (`file_lock`), so parallel
jobs never race on them; sqlite writers then wait on each other through a busy timeout instead of
failing with "database is locked". For a tracking server no local lock is used (jobs run on
different nodes): the server serialises writes, and an experiment created by another job between
our lookup and our create is simply looked up again.

Tracking never stops a job (`tracking.enabled`): with `auto` (the default) a node where mlflow
does not import, or whose store does not answer, runs the job untracked and says so once
(`say_off`); the probe of a server is a short TCP connect, because MLflow's own client retries an
unreachable server for minutes. `true` turns each of these into an error before training starts,
`false` never imports mlflow. Every mlflow import is inside a function.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import unquote, urlsplit

from dpadapter.settings import Config, TrackingConfig
from dpadapter.tracking.naming import EXPERIMENT_TAGS

SQLITE_TIMEOUT_S = 60
# How long `auto` waits for a tracking server to accept a connection before running untracked.
PROBE_TIMEOUT_S = 5.0
# Every run's files (metrics.json, ...) under its config's results folder, not the working dir.
ARTIFACTS_DIR = "mlartifacts"


class TrackingError(RuntimeError):
    """Tracking cannot run as configured: raised under `enabled: true`, else said once."""


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


def lock_path(uri: str) -> Path | None:
    """The lock file guarding schema and experiment creation (sqlite only)."""
    db = _sqlite_path(uri)
    return None if db is None else db.with_name(db.name + ".lock")


@contextlib.contextmanager
def file_lock(path: Path | None) -> Iterator[None]:
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


def artifact_location(results_dir: str | Path | None = None) -> str:
    """`<results_dir>/mlartifacts` as a file URI (absolute: jobs run from other directories)."""
    folder = Path.cwd() if results_dir is None else Path(results_dir).resolve()
    return (folder / ARTIFACTS_DIR).as_uri()


def _as_path(location: str) -> Path | None:
    """The local folder an artifact location names; None for a remote one (s3:, ...)."""
    u = urlsplit(location)
    if u.scheme == "file":
        return Path(unquote(u.path)).resolve()
    if u.scheme == "":
        return Path(location).resolve()
    return None


def _check_location(exp, wanted: str, uri: str) -> None:
    have = _as_path(exp.artifact_location)
    if have is not None and have == _as_path(wanted):
        return
    store = uri.split("?", 1)[0]
    raise TrackingError(
        f"MLflow experiment {exp.name!r} in {store} keeps its artifacts in "
        f"{exp.artifact_location}, not in {_as_path(wanted)} (this config's results folder); "
        "its runs would write their files into another experiment's folder. Give this config "
        f"its own experiment (`tracking.experiment: {exp.name}-<name>`), or rename the old one: "
        f"MLFLOW_TRACKING_URI='{store}' mlflow experiments rename "
        f"--experiment-id {exp.experiment_id} --new-name {exp.name}-old"
    )


def _get_or_create(name: str, artifacts: str, uri: str) -> str:
    import mlflow
    from mlflow.exceptions import MlflowException

    exp = mlflow.get_experiment_by_name(name)
    if exp is None:
        try:
            return mlflow.create_experiment(name, artifact_location=artifacts, tags=EXPERIMENT_TAGS)
        except MlflowException:
            # Another job (on another node, against a server) created it in between.
            exp = mlflow.get_experiment_by_name(name)
            if exp is None:
                raise
    _check_location(exp, artifacts, uri)
    if any(exp.tags.get(k) != v for k, v in EXPERIMENT_TAGS.items()):
        # Created before the tag existed (or by hand): open it on the runs table too.
        for k, v in EXPERIMENT_TAGS.items():
            mlflow.MlflowClient().set_experiment_tag(exp.experiment_id, k, v)
    if exp.lifecycle_stage == "deleted":
        # Deleted in the UI but still holding the name: runs cannot start in it until restored.
        mlflow.MlflowClient().restore_experiment(exp.experiment_id)
    return exp.experiment_id


def ensure_experiment(cfg: TrackingConfig, results_dir: str | Path | None = None) -> str:
    """Create the store and the experiment once (under a lock); return the experiment id.

    The experiment keeps its artifacts under `<results_dir>/mlartifacts`; an existing one that
    keeps them elsewhere is refused (TrackingError), never silently shared."""
    import mlflow

    uri = resolve_uri(cfg, results_dir)
    mlflow.set_tracking_uri(uri)
    with file_lock(lock_path(uri)):
        return _get_or_create(cfg.experiment, artifact_location(results_dir), uri)


def probe(uri: str) -> str | None:
    """Why a tracking server cannot be used, or None; a store that is not a server is not probed
    here (creating its experiment is its probe)."""
    u = urlsplit(uri)
    if u.scheme not in ("http", "https"):
        return None
    port = u.port or (443 if u.scheme == "https" else 80)
    try:
        with socket.create_connection((u.hostname or "", port), timeout=PROBE_TIMEOUT_S):
            return None
    except OSError as exc:
        return f"the tracking server {uri} does not answer ({exc})"


# One decision per store, experiment and artifact folder, per process: (experiment id, why off).
_DECISIONS: dict[tuple[str, str, str], tuple[str | None, str | None]] = {}
_SAID: set[str] = set()


def say_off(reason: str) -> None:
    """One line per reason and process, however many places find tracking off."""
    if reason not in _SAID:
        _SAID.add(reason)
        print(
            f"tracking off: {reason}. The job runs without MLflow "
            "(tracking.enabled: auto; docs/tracking.md).",
            file=sys.stderr,
            flush=True,
        )


def experiment(cfg: TrackingConfig, results_dir: str | Path | None = None) -> str | None:
    """The experiment id when tracking is on; None when it is off (said once, mlflow untouched
    when `enabled` is false). Raises TrackingError when `enabled` is true and it cannot run."""
    if cfg.enabled is False:
        return None
    uri = resolve_uri(cfg, results_dir)
    key = (uri, cfg.experiment, artifact_location(results_dir))
    if key not in _DECISIONS:
        exp_id, reason = None, None
        try:
            import mlflow  # noqa: F401
        except ImportError as exc:
            reason = f"mlflow cannot be imported ({type(exc).__name__}: {exc})"
        else:
            reason = probe(uri)
        if reason is None:
            try:
                exp_id = ensure_experiment(cfg, results_dir)
            except TrackingError as exc:
                reason = str(exc)
            except Exception as exc:  # the store's own errors: sqlite, HTTP, permissions
                store = uri.split("?", 1)[0]
                reason = f"the store {store} fails ({type(exc).__name__}: {exc})"
        _DECISIONS[key] = (exp_id, reason)
    exp_id, reason = _DECISIONS[key]
    if reason is not None:
        if cfg.enabled is True:
            raise TrackingError(f"tracking.enabled is true, but {reason}")
        say_off(reason)
    else:
        import mlflow

        mlflow.set_tracking_uri(uri)  # the fluent calls' store, should another have been set since
    return exp_id


def check(cfg: Config) -> None:
    """Before any job (the workflow's onstart): required tracking that cannot run stops here."""
    if cfg.tracking.enabled is True:
        experiment(cfg.tracking, cfg.results_dir)
