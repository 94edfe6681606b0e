"""A run's life in the store: opened (new, numbered as a rerun, or resumed) under its stage's
group run, and ended when its job can no longer end it.

A run left RUNNING by SIGKILL is ended FAILED by the next attempt of the same job
(`end_stale_runs`), or continued when the job resumes; any run of this host whose process is gone
is ended KILLED before every new run and when `make mlflow` opens the UI (`end_dead_runs`).
Parallel jobs that need one group run make one (`group_run`): under the sqlite lock, or, against
a server, by keeping the oldest (docs/tracking.md). Every mlflow import is inside a function.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

from dpadapter.tracking.naming import GROUP_TAG, HOST_TAG, JOB_TAG, PID_TAG
from dpadapter.tracking.store import file_lock, lock_path
from dpadapter.workflow.reruns import mark_replaced, number, quoted, runs_tagged


def group_run(exp_id: str, key: str, name: str, tags: dict[str, str], uri: str) -> str:
    """The group run of `key`, created by the first job that needs it (parallel jobs: one).

    With sqlite the lookup and the creation happen under the store's lock. A server has no
    shared lock: each job that found none creates one, then every job keeps the oldest and a job
    whose own is not the oldest deletes it, so the children of a grid end under one parent
    (docs/tracking.md)."""
    import mlflow

    client = mlflow.MlflowClient()
    with file_lock(lock_path(uri)):
        found = runs_tagged(client, exp_id, GROUP_TAG, key)
        if found:
            return found[0].info.run_id
        run = client.create_run(exp_id, run_name=name, tags={**tags, GROUP_TAG: key})
        client.set_terminated(run.info.run_id, status="FINISHED")
    if lock_path(uri) is None:
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


def process_id(pid: int) -> str | None:
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
    return pid.isdigit() and process_id(int(pid)) != process


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
        # The search is older than the check: a job that ended its run (FINISHED, FAILED) and
        # exited in between looks gone too. A job ends its run before its process exits, so a
        # status read after the process was seen gone is the last word: still RUNNING, killed.
        if _process_gone(r.data.tags.get(PID_TAG)):
            if client.get_run(r.info.run_id).info.status != "RUNNING":
                continue
            client.set_tag(r.info.run_id, "dpadapter.ended_by", "its process was gone (killed)")
            client.set_terminated(r.info.run_id, status="KILLED")
            ended.append(r.info.run_id)
    return ended


def open_run(
    exp_id: str,
    run_name: str,
    tags: dict[str, str],
    run_id: str | None,
    parent: str | tuple[str, str] | None,
    uri: str,
    system_metrics: bool = False,
):
    """Start (or resume) the run: the job's own run, nested under `parent` (a run id, or a
    group's (key, name) whose run is found or made). A new run in a slot that already has runs
    is numbered and marks the runs it replaces (dpadapter.workflow.reruns); a resumed one is not.
    `system_metrics`: MLflow samples the machine's utilisation into the run until it ends."""
    import mlflow
    from mlflow.exceptions import MlflowException

    if run_id is not None:
        try:
            mlflow.MlflowClient().get_run(run_id)
        except MlflowException:  # resume state from another store, or from an untracked attempt
            run_id = None
    end_dead_runs(exp_id)
    me = {PID_TAG: process_id(os.getpid()) or "", HOST_TAG: socket.gethostname()}
    if run_id is not None:
        run = mlflow.start_run(run_id=run_id, log_system_metrics=system_metrics)
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
    run = mlflow.start_run(
        experiment_id=exp_id, run_name=run_name, tags=tags, log_system_metrics=system_metrics
    )
    mark_replaced(mlflow.MlflowClient(), earlier, run.info.run_id)
    return run
