"""Training-job-like MLflow clients, N of them racing at once, for test_mlflow_load.py.

Usage: python mlflow_worker.py <n> <experiment> <barrier_dir> <steps> [<group>]
The tracking URI comes from MLFLOW_TRACKING_URI, as in a Snakemake job. This process imports
everything once, then forks n workers, as the pipeline's fork server forks its jobs after
importing MLflow (`dpadapter.launch.prefork`): each reports `ready-<index>` in barrier_dir and
waits for `go`, so all of them create the store, the experiment and their runs at the same
instant, and writes its output to `out-<index>.txt` there. It prints one line per worker,
`worker <index> rc <status>`, and exits 1 if any failed. With <group>, each run is nested under
the group run of that key, which the first of them creates.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from pathlib import Path

import mlflow.store.tracking.sqlalchemy_store  # noqa: F401  (import cost before the barrier)

from dpadapter import tracking
from dpadapter.settings import TrackingConfig


def work(experiment: str, index: int, barrier: Path, steps: int, group_key: str | None) -> int:
    (barrier / f"ready-{index}").touch()
    deadline = time.monotonic() + 600
    while not (barrier / "go").exists():
        if time.monotonic() > deadline:
            print("no go signal", file=sys.stderr)
            return 3
        time.sleep(0.002)
    cfg = TrackingConfig(experiment=experiment)
    tags = {"rule": "load", "wildcard.worker": str(index)}
    group = (group_key, group_key) if group_key else None
    with tracking.start_run(cfg, run_name=f"load/{index}", tags=tags, parent=group) as run:
        run.log_params({"worker": index, "grid": {"eps": [1, 4], "seed": index}})
        run.log_params({"target_epsilon": 4, "noise_multiplier": 1.25, "seed": index})
        for step in range(1, steps + 1):
            run.log_metrics({"loss": 1.0 / step + index, "epsilon_spent": 0.1 * step}, step=step)
        run.log_metrics({"test_accuracy": index / 10})
    print(f"worker {index} done")
    return 0


def _child(index: int, barrier: Path, args: tuple) -> None:
    """A forked worker: its output to out-<index>.txt, its status as its exit code."""
    fd = os.open(barrier / f"out-{index}.txt", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    try:
        rc = work(args[0], index, barrier, *args[1:])
    except BaseException:
        traceback.print_exc()
        rc = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


def main() -> int:
    n, experiment, barrier = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    steps, group = int(sys.argv[4]), (sys.argv[5] if len(sys.argv) > 5 else None)
    # fork is safe only from a single-threaded process (what the fork server checks too)
    assert threading.active_count() == 1, threading.enumerate()
    sys.stdout.flush()
    pids = {}
    for index in range(n):
        pid = os.fork()
        if pid == 0:
            _child(index, barrier, (experiment, steps, group))
        pids[pid] = index
    failed = 0
    for _ in range(n):
        pid, status = os.wait()
        rc = os.waitstatus_to_exitcode(status)
        failed += rc != 0
        print(f"worker {pids[pid]} rc {rc}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
