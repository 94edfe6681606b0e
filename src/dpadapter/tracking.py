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

Tracking never stops a job (`tracking.enabled`): with `auto` (the default) a node where mlflow
does not import, or whose store does not answer, runs the job untracked and says so once; the
probe of a server is a short TCP connect, because MLflow's own client retries an unreachable
server for minutes. `true` turns each of these into an error before training starts, `false`
never imports mlflow. Where the runs go, and why they are nested: docs/tracking.md.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import socket
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from dpadapter.config import Config, TrackingConfig
from dpadapter.identity import config_hash, run_prefix
from dpadapter.reruns import SLOT_TAG, mark_replaced, number, quoted, runs_tagged, slot

SQLITE_TIMEOUT_S = 60
# How long `auto` waits for a tracking server to accept a connection before running untracked.
PROBE_TIMEOUT_S = 5.0
# Every run's files (metrics.json, ...) under its config's results folder, not the working dir.
ARTIFACTS_DIR = "mlartifacts"
# The group (parent) run of one stage of one config, and the job a run belongs to.
GROUP_TAG = "dpadapter.group"
JOB_TAG = "dpadapter.job"
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


class TrackingError(RuntimeError):
    """Tracking cannot run as configured: raised under `enabled: true`, else said once."""


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
    with _file_lock(_lock_path(uri)):
        return _get_or_create(cfg.experiment, artifact_location(results_dir), uri)


def _probe(uri: str) -> str | None:
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


def _say_off(reason: str) -> None:
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
            reason = _probe(uri)
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
        _say_off(reason)
    else:
        import mlflow

        mlflow.set_tracking_uri(uri)  # the fluent calls' store, should another have been set since
    return exp_id


def check(cfg: Config) -> None:
    """Before any job (the workflow's onstart): required tracking that cannot run stops here."""
    if cfg.tracking.enabled is True:
        experiment(cfg.tracking, cfg.results_dir)


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
    """A thin handle so training code logs without importing mlflow itself.

    Off (tracking off, or a store that failed during the job under `auto`), every call does
    nothing: a job's result never depends on its tracking. Under `enabled: true` a failing call
    raises."""

    def __init__(self, mlflow_mod=None, run=None, strict: bool = False):
        self._mlflow = mlflow_mod
        self.run = run
        self.run_id = None if run is None else run.info.run_id
        self._strict = strict
        self._live = mlflow_mod is not None

    @property
    def on(self) -> bool:
        return self._live

    def _call(self, fn: Callable[..., Any], *args, **kwargs) -> Any:
        if not self._live:
            return None
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            if self._strict:
                raise
            self._live = False
            _say_off(f"the store failed during the job ({type(exc).__name__}: {exc})")
            return None

    def log_params(self, params: dict[str, Any]) -> None:
        flat = {k: ("None" if v is None else v) for k, v in _flatten(params).items()}
        items = list(flat.items())
        for i in range(0, len(items), 100):
            chunk = dict(items[i : i + 100])
            self._call(lambda chunk=chunk: self._mlflow.log_params(chunk))

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        clean = {
            k: float(v)
            for k, v in _flatten(metrics).items()
            if isinstance(v, int | float) and not isinstance(v, bool)
        }
        if clean:
            self._call(lambda: self._mlflow.log_metrics(clean, step=step))

    def set_tags(self, tags: dict[str, Any]) -> None:
        """Tags may change on a resumed run (another node, another GPU); params may not."""
        self._call(lambda: self._mlflow.set_tags({k: str(v) for k, v in tags.items()}))

    def log_artifact(self, path: str | Path) -> None:
        self._call(lambda: self._mlflow.log_artifact(str(path)))

    def log_new(self, params: dict[str, Any], metrics: dict[str, float]) -> None:
        """Params and metrics this run does not hold yet (a stage may have logged them itself,
        and MLflow refuses to change a param)."""
        data = self._call(lambda: self._mlflow.get_run(self.run_id).data)
        if data is None:
            return
        self.log_params({k: v for k, v in params.items() if k not in data.params})
        self.log_metrics({k: v for k, v in metrics.items() if k not in data.metrics})

    def end(self, status: str) -> None:
        """Ended even after a failed call (the store may answer again): not left RUNNING."""
        if self._mlflow is None:
            return
        try:
            self._mlflow.end_run(status)
        except Exception:
            if self._strict:
                raise


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
    # once: Slurm signals every process of a step, the child of dpadapter.supervise gets its
    # parent's copy too, and a second SystemExit would cut short the unwinding that ends the run
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
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


# Wildcards in the order a run name reads them, and their tag names (the DP params' names).
_NAME_ORDER = ("algo", "mechanism", "strategy", "upstream", "task")
_TAG_OF = {"algo": "algorithm", "eps": "epsilon"}


def run_name(stage: str, wildcards: dict[str, str]) -> str:
    """`finetune dpsgd standard fmnist-same ε=1 s0`: what the runs table shows of a job."""
    w = dict(wildcards)
    parts = [stage, *(w.pop(k) for k in _NAME_ORDER if k in w)]
    seed = w.pop("seed", None)
    if "eps" in w:
        parts.append(f"ε={w.pop('eps')}")
    parts += [f"{k}={v}" for k, v in w.items()]
    if seed is not None:
        parts.append(f"s{seed}")
    return " ".join(parts)


@dataclass(frozen=True)
class Job:
    """How one job appears in MLflow: its run's name and tags, and its stage's group run."""

    name: str
    tags: dict[str, str]
    group: str
    group_name: str


def job(cfg: Config, stage: str, wildcards: dict[str, str]) -> Job:
    """The tags the UI groups and filters by (stage, upstream, task, algorithm, epsilon, seed,
    the config's hash); a stage's runs of one config share one group run (`hpo_trial` and
    `hpo_final` are `hpo`)."""
    h = config_hash(cfg)
    family = stage.split("_", 1)[0]
    tags = {
        "stage": stage,
        "config": h,
        "results_dir": cfg.results_dir,
        **{_TAG_OF.get(k, k): str(v) for k, v in wildcards.items()},
        JOB_TAG: "/".join([h, stage, *map(str, wildcards.values())]),
        SLOT_TAG: slot(cfg.results_dir, stage, wildcards),  # a rerun is numbered (reruns)
    }
    return Job(run_name(stage, wildcards), tags, f"{h}/{family}", f"{family} · {run_prefix(cfg)}")


def group_run(exp_id: str, key: str, name: str, tags: dict[str, str], uri: str) -> str:
    """The group run of `key`, created by the first job that needs it (parallel jobs: one).

    With sqlite the lookup and the creation happen under the store's lock. A server has no
    shared lock: each job that found none creates one, then every job keeps the oldest and a job
    whose own is not the oldest deletes it, so the children of a grid end under one parent
    (docs/tracking.md)."""
    import mlflow

    client = mlflow.MlflowClient()
    with _file_lock(_lock_path(uri)):
        found = runs_tagged(client, exp_id, GROUP_TAG, key)
        if found:
            return found[0].info.run_id
        run = client.create_run(exp_id, run_name=name, tags={**tags, GROUP_TAG: key})
        client.set_terminated(run.info.run_id, status="FINISHED")
    if _lock_path(uri) is None:
        oldest = runs_tagged(client, exp_id, GROUP_TAG, key)[0].info.run_id
        if oldest != run.info.run_id:
            client.delete_run(run.info.run_id)
        return oldest
    return run.info.run_id


def end_stale_runs(experiment_id: str, job_key: str, keep: str | None = None) -> list[str]:
    """End FAILED the runs of this job still RUNNING (an earlier attempt killed by SIGKILL)."""
    import mlflow

    client = mlflow.MlflowClient()
    stale = runs_tagged(
        client, experiment_id, JOB_TAG, job_key, " and attributes.status = 'RUNNING'"
    )
    ended = []
    for r in stale:
        if r.info.run_id != keep:
            client.set_tag(r.info.run_id, "dpadapter.ended_by", "a later attempt of the same job")
            client.set_terminated(r.info.run_id, status="FAILED")
            ended.append(r.info.run_id)
    return ended


# The job process of a run: "<pid>:<its start time>" (a pid alone may be reused), and its host.
PID_TAG, HOST_TAG = "dpadapter.process", "dpadapter.host"


def _process_id(pid: int) -> str | None:
    """`<pid>:<start time in clock ticks since boot>` (field 22 of /proc/<pid>/stat)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return f"{pid}:{stat.rsplit(')', 1)[1].split()[19]}"


def _process_gone(process: str | None) -> bool:
    """Whether the job process recorded as `process` (of this host) has ended; a reused pid
    has another start time, so it counts as ended too."""
    if not process or ":" not in process:
        return False  # nothing recorded: cannot tell
    pid = process.split(":", 1)[0]
    return pid.isdigit() and _process_id(int(pid)) != process


def end_dead_runs(experiment_id: str) -> list[str]:
    """End KILLED every job run of this host left RUNNING by a process that is gone.

    SIGKILL (the out-of-memory killer, `kill -9`, a node's cgroup) gives a job no chance to
    end its run, and its next attempt may never come; this runs before every new run and
    when `make mlflow` opens the UI, so a killed job shows as KILLED, not as still running."""
    import mlflow

    client = mlflow.MlflowClient()
    host = socket.gethostname()
    running = client.search_runs(
        [experiment_id],
        filter_string=f"attributes.status = 'RUNNING' and tags.`{HOST_TAG}` = {quoted(host)}",
        max_results=1000,
    )
    ended = []
    for r in running:
        if _process_gone(r.data.tags.get(PID_TAG)):
            client.set_tag(r.info.run_id, "dpadapter.ended_by", "its process was gone (killed)")
            client.set_terminated(r.info.run_id, status="KILLED")
            ended.append(r.info.run_id)
    return ended


def _open(
    cfg: TrackingConfig,
    exp_id: str,
    run_name: str,
    tags: dict[str, str],
    run_id: str | None,
    parent: str | tuple[str, str] | None,
    uri: str,
):
    """Start (or resume) the run: the job's own run, nested under `parent` (a run id, or a
    group's (key, name) whose run is found or made)."""
    import mlflow
    from mlflow.exceptions import MlflowException

    if run_id is not None:
        try:
            mlflow.MlflowClient().get_run(run_id)
        except MlflowException:  # resume state from another store, or from an untracked attempt
            run_id = None
    end_dead_runs(exp_id)
    me = {PID_TAG: _process_id(os.getpid()) or "", HOST_TAG: socket.gethostname()}
    if run_id is not None:
        run = mlflow.start_run(run_id=run_id)
        end_stale_runs(exp_id, run.data.tags.get(JOB_TAG, run_name), keep=run_id)
        mlflow.set_tags(me)  # the resumed run's process is this one now
        return run
    tags = {JOB_TAG: run_name, **tags, **me}
    if isinstance(parent, tuple):
        # Not `stage`: a filter on it finds the jobs of a stage, not their group.
        group_tags = {k: v for k, v in tags.items() if k in ("config", "results_dir")}
        parent = group_run(exp_id, parent[0], parent[1], group_tags, uri)
    if parent is not None:
        tags["mlflow.parentRunId"] = parent
    end_stale_runs(exp_id, tags[JOB_TAG])
    run_name, tags, earlier = number(mlflow.MlflowClient(), exp_id, run_name, tags)
    run = mlflow.start_run(experiment_id=exp_id, run_name=run_name, tags=tags)
    mark_replaced(mlflow.MlflowClient(), earlier, run.info.run_id)
    return run


@contextlib.contextmanager
def start_run(
    cfg: TrackingConfig,
    run_name: str,
    tags: dict[str, str],
    run_id: str | None = None,
    results_dir: str | Path | None = None,
    parent: str | tuple[str, str] | None = None,
) -> Iterator[Run]:
    """A new run, or the run of an interrupted job being resumed (its metrics continue).

    Yields an off Run when tracking is off; a run that cannot start under `auto` is off too."""
    exp_id = experiment(cfg, results_dir)
    strict = cfg.enabled is True
    with _failed_on_sigterm():
        handle = Run()
        if exp_id is not None:
            import mlflow

            try:
                uri = resolve_uri(cfg, results_dir)
                handle = Run(
                    mlflow, _open(cfg, exp_id, run_name, tags, run_id, parent, uri), strict
                )
            except Exception as exc:
                if strict:
                    raise
                _say_off(f"the run could not start ({type(exc).__name__}: {exc})")
        try:
            yield handle
        except BaseException as exc:
            handle.end("KILLED" if isinstance(exc, KeyboardInterrupt) else "FAILED")
            raise
        handle.end("FINISHED")


def log_metrics_to(
    cfg: TrackingConfig, results_dir: str | Path | None, run_id: str | None, metrics: dict
) -> None:
    """Metrics onto another job's run (the HPO parent's totals), if tracking is on."""
    if run_id is None or experiment(cfg, results_dir) is None:
        return
    import math

    import mlflow

    client = mlflow.MlflowClient()

    def log() -> None:
        for k, v in metrics.items():
            if isinstance(v, int | float) and math.isfinite(v):
                client.log_metric(run_id, k, float(v))

    Run(mlflow, strict=cfg.enabled is True)._call(log)


def _serve(store: str, port: int, url: str) -> int:
    """`mlflow ui` over a local store, the browser opened on `url` once the UI answers."""
    import subprocess
    import time
    import urllib.request
    import webbrowser

    cmd = [sys.executable, "-m", "mlflow", "ui", "--host", "127.0.0.1", "--port", str(port)]
    ui = subprocess.Popen([*cmd, "--backend-store-uri", store])
    try:
        deadline = time.monotonic() + 120
        while ui.poll() is None and time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                    break
            except OSError:
                time.sleep(0.5)
        if ui.poll() is None:
            print(f"open:  {url}", flush=True)
            webbrowser.open(url)  # False, and nothing shown, where there is no browser
        return ui.wait()
    except KeyboardInterrupt:
        ui.terminate()
        return ui.wait()


def main(argv: list[str] | None = None) -> int:
    """`python -m dpadapter.tracking CONFIG [--serve] [--port N]`: where a config's runs are.

    Prints the store and the URL of the config's experiment in the "DP runs" view. `--serve`
    (`make mlflow`) starts `mlflow ui` over a local store and opens that URL; with a tracking
    server the URL is the server's and nothing is started.
    """
    import argparse

    from dpadapter.config import load

    ap = argparse.ArgumentParser(prog="python -m dpadapter.tracking")
    ap.add_argument("config")
    ap.add_argument("--serve", action="store_true", help="start the UI on a local store")
    ap.add_argument("--port", type=int, default=5000)
    args = ap.parse_args(argv)
    cfg = load(args.config)
    uri = resolve_uri(cfg.tracking, cfg.results_dir)
    store = uri.split("?", 1)[0]
    server = urlsplit(uri).scheme in ("http", "https")
    base = store if server else f"http://127.0.0.1:{args.port}"
    try:
        why = _probe(uri)
        if why is not None:
            raise TrackingError(why)
        exp_id = ensure_experiment(cfg.tracking, cfg.results_dir)
    except TrackingError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    ended = end_dead_runs(exp_id)
    if ended:
        print(f"ended KILLED: {len(ended)} run(s) whose job process was gone")
    url = runs_url(base, exp_id)
    print(f"store: {store}")
    print(f"runs:  {url}", flush=True)
    if args.serve and not server:
        return _serve(store, args.port, url)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
