"""`snakemake` with the Slurm executor plugin's status queries at the interval asked for.

The plugin (2.x) waits 10 s longer after every status query that finds no job finished (up to
180 s, then back to its initial wait), whatever `--seconds-between-status-checks` says. On a real
cluster, with jobs of minutes to hours, that spares slurmctld; on the test cluster, whose jobs
last seconds, a job that ended 14 s after it started was noticed 19 s later, and the Slurm test
spent about a third of its time waiting for nothing. This runs the installed Snakemake and
plugin unchanged except that each status check is followed by the command's own interval.
"""

from __future__ import annotations

import sys

from snakemake.cli import main
from snakemake_executor_plugin_slurm import Executor

_check_active_jobs = Executor.check_active_jobs


async def _steady_check_active_jobs(self, active_jobs):
    async for job in _check_active_jobs(self, active_jobs):
        yield job
    self.next_seconds_between_status_checks = None  # None: `--seconds-between-status-checks`


Executor.check_active_jobs = _steady_check_active_jobs

if __name__ == "__main__":
    sys.exit(main())
