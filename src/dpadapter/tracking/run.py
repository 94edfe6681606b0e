"""What a job uses: `start_run` opens its MLflow run, and `Run` logs to it without mlflow.

A job killed by SIGTERM (Slurm's time limit, `scancel`, preemption) ends its run FAILED instead
of leaving it RUNNING: `start_run` turns the signal into SystemExit(143), which unwinds the job
and the run is ended FAILED. Tracking off (or a store failing during the job under `auto`), every
call of the Run does nothing: a job's result never depends on its tracking.
"""

from __future__ import annotations

import contextlib
import json
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from dpadapter.settings import TrackingConfig
from dpadapter.tracking.lifecycle import open_run
from dpadapter.tracking.store import experiment, resolve_uri, say_off


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
            say_off(f"the store failed during the job ({type(exc).__name__}: {exc})")
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


def _sigterm_to_exit(signum, frame):
    # once: Slurm signals every process of a step, the child of dpadapter.launch.supervise gets its
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


def samples_system(cfg: TrackingConfig, on_cuda: bool) -> bool:
    """Whether a job's run gets MLflow's system metrics (`tracking.system_metrics`)."""
    return cfg.system_metrics is True or (cfg.system_metrics == "auto" and on_cuda)


@contextlib.contextmanager
def start_run(
    cfg: TrackingConfig,
    run_name: str,
    tags: dict[str, str],
    run_id: str | None = None,
    results_dir: str | Path | None = None,
    parent: str | tuple[str, str] | None = None,
    on_cuda: bool = False,
) -> Iterator[Run]:
    """A new run, or the run of an interrupted job being resumed (its metrics continue).

    Yields an off Run when tracking is off; a run that cannot start under `auto` is off too.
    `on_cuda`: the job trains on a GPU (`tracking.system_metrics: auto` samples its use)."""
    exp_id = experiment(cfg, results_dir)
    strict = cfg.enabled is True
    with _failed_on_sigterm():
        handle = Run()
        if exp_id is not None:
            import mlflow

            try:
                uri = resolve_uri(cfg, results_dir)
                system = samples_system(cfg, on_cuda)
                run = open_run(exp_id, run_name, tags, run_id, parent, uri, system)
                handle = Run(mlflow, run, strict)
            except Exception as exc:
                if strict:
                    raise
                say_off(f"the run could not start ({type(exc).__name__}: {exc})")
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
