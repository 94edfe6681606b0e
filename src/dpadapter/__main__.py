"""`python -m dpadapter`: run one stage, then leave without tearing the interpreter down.

Every rule runs one such process and it exits right after its outputs are written. A normal
exit then spends over a second of CPU finalizing the thousands of module objects that torch,
Opacus and MLflow import, memory the OS reclaims anyway (measured on this 2-core machine:
4.4 s -> 3.0 s user CPU for a process that imports them and logs one MLflow run), and every job
of a grid pays it. So after `main` returns, what a normal exit does with an effect outside the
process is done explicitly (non-daemon threads joined, atexit handlers run: MLflow flushes
there, standard streams flushed) and the process ends with `os._exit`. Result files are written
through closed handles (atomic renames), so nothing buffered is lost. An exception still exits
the normal way, with its traceback. `DPADAPTER_FULL_EXIT=1` restores the normal exit.

In a local Snakemake run the job is run by a child of the workflow's preforked server, which
has imported torch, Opacus and MLflow once for all jobs (`dpadapter.launch.prefork`); this process
then
only waits for it. Without a server (a cluster job, `DPADAPTER_PREFORK=0`) it forks before
importing torch and its child runs the job, so that a job killed for memory is reported by the
waiting parent (`dpadapter.launch.supervise`).
"""

import os
import sys

from dpadapter.launch.prefork import delegate, finish_process
from dpadapter.launch.supervise import supervise

_delegated = delegate(sys.argv[1:])
if _delegated is not None:
    os._exit(_delegated)
supervise(sys.argv[1:])  # the parent waits for the child and exits with its status here

from dpadapter.launch.cli import main  # noqa: E402  (only where no server runs the job)


def _exit_without_teardown(code: int) -> None:
    finish_process()
    os._exit(code)


rc = main()
if os.environ.get("DPADAPTER_FULL_EXIT", "") not in ("", "0") or not isinstance(rc, int | None):
    sys.exit(rc)
_exit_without_teardown(rc or 0)
