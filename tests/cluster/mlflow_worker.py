"""One training-job-like MLflow client, started N times at once by test_mlflow_load.py.

Usage: python mlflow_worker.py <experiment> <index> <barrier_dir> <steps> [<group>]
The tracking URI comes from MLFLOW_TRACKING_URI, as in a Snakemake job. Each worker imports
everything first, reports `ready-<index>` in barrier_dir and waits for `go`, so all of them
create the store, the experiment and their runs at the same instant. With <group>, each run is
nested under the group run of that key, which the first of them creates.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import mlflow.store.tracking.sqlalchemy_store  # noqa: F401  (import cost before the barrier)

from dpadapter import tracking
from dpadapter.settings import TrackingConfig


def main() -> int:
    experiment, index, barrier, steps = (
        sys.argv[1],
        int(sys.argv[2]),
        Path(sys.argv[3]),
        int(sys.argv[4]),
    )
    (barrier / f"ready-{index}").touch()
    deadline = time.monotonic() + 600
    while not (barrier / "go").exists():
        if time.monotonic() > deadline:
            print("no go signal", file=sys.stderr)
            return 3
        time.sleep(0.002)
    cfg = TrackingConfig(experiment=experiment)
    tags = {"rule": "load", "wildcard.worker": str(index)}
    group = (sys.argv[5], sys.argv[5]) if len(sys.argv) > 5 else None
    with tracking.start_run(cfg, run_name=f"load/{index}", tags=tags, parent=group) as run:
        run.log_params({"worker": index, "grid": {"eps": [1, 4], "seed": index}})
        run.log_params({"target_epsilon": 4, "noise_multiplier": 1.25, "seed": index})
        for step in range(1, steps + 1):
            run.log_metrics({"loss": 1.0 / step + index, "epsilon_spent": 0.1 * step}, step=step)
        run.log_metrics({"test_accuracy": index / 10})
    print(f"worker {index} done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
