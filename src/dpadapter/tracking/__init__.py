"""MLflow: one run per training job, safe when many jobs start at once; never stops a job.

A job's whole view of tracking (dpadapter.train.job.training_job)::

    job = tracking.job(cfg, stage, wildcards)           # its run's name, tags and group run
    with tracking.start_run(cfg.tracking, job.name, job.tags, results_dir=cfg.results_dir,
                            parent=(job.group, job.group_name)) as run:
        run.log_metrics(...)                            # a no-op when tracking is off
        run.log_new(*tracking.dp_summary(metrics))      # the DP columns of metrics.json

The rooms, by what a reader looks for:

- `run`: the run wrapper a job uses (`start_run`, `Run`), SIGTERM ending a run FAILED.
- `naming`: run names, tags, group runs' keys, the DP columns and the "DP runs" view.
- `store`: the URI (env, config, else `<results_dir>/mlruns.db`), the sqlite lock, the
  experiment, and whether tracking is on (`tracking.enabled`: auto / true / false).
- `lifecycle`: opening a run (new, numbered rerun, resumed) under its group run, and ending the
  runs that killed jobs left RUNNING.
- `ui`: `make mlflow` (`python -m dpadapter.tracking CONFIG --serve`).

mlflow is imported only inside functions: with `tracking.enabled: false` a job never imports it,
and under `auto` a node without it runs untracked. Where the runs go, and why they are nested:
docs/tracking.md.

Layer 0, beside the settings: it may import only the ground floor (`ground`, `settings`,
`workflow`), so any job, at any layer, can be tracked.
"""

from dpadapter.tracking.lifecycle import end_dead_runs, end_stale_runs, group_run
from dpadapter.tracking.naming import (
    DP_METRICS,
    DP_PARAMS,
    DP_VIEW,
    EXPERIMENT_TAGS,
    GROUP_TAG,
    HOST_TAG,
    JOB_TAG,
    PID_TAG,
    Job,
    dp_summary,
    job,
    run_name,
    runs_url,
)
from dpadapter.tracking.run import Run, log_metrics_to, start_run
from dpadapter.tracking.store import (
    TrackingError,
    artifact_location,
    check,
    ensure_experiment,
    experiment,
    resolve_uri,
)
from dpadapter.tracking.ui import main

__all__ = [
    "DP_METRICS",
    "DP_PARAMS",
    "DP_VIEW",
    "EXPERIMENT_TAGS",
    "GROUP_TAG",
    "HOST_TAG",
    "JOB_TAG",
    "PID_TAG",
    "Job",
    "Run",
    "TrackingError",
    "artifact_location",
    "check",
    "dp_summary",
    "end_dead_runs",
    "end_stale_runs",
    "ensure_experiment",
    "experiment",
    "group_run",
    "job",
    "log_metrics_to",
    "main",
    "resolve_uri",
    "run_name",
    "runs_url",
    "start_run",
]
