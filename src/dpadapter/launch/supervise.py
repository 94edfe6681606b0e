"""A job run in its own process is watched by a light parent, so an out-of-memory kill says so.

The kernel's out-of-memory killer ends a training process with SIGKILL, which nothing can
catch: a process killed that way prints nothing, and the console of a cluster job or a
`DPADAPTER_PREFORK=0` run showed only `exit 137` (issue 36, item 5). A job forked from the
prefork server is told apart by its waiting client (`prefork.delegate`); this gives a job that
runs without a server the same: `python -m dpadapter` forks before importing torch, the child
goes on to run the job (and exits as it always did, `os._exit` included), and the parent, a
bare interpreter of a few MB that the OOM killer never picks over the child, waits for it.

The parent passes SIGTERM, SIGINT, SIGHUP (and SIGUSR1/2) on to the child, once: the child
leads its own session, so a terminal's Ctrl-C or a signal to the job's process group reaches
the parent alone (as with the prefork server's children), and it dies with the parent
(`PR_SET_PDEATHSIG`), so a job whose process is killed never runs on. If the child dies of a
SIGKILL the parent did not pass on, the parent prints `prefork.killed_message` and exits 137;
otherwise it exits with the child's status (128 + the signal for another signal). The child is
the process that trains, so the MLflow run records its pid (`tracking.PID_TAG`) and
`tracking.end_dead_runs` ends the run KILLED once it is gone.

`DPADAPTER_SUPERVISE=0` runs the job in the process itself (a debugger on the job's pid,
a profiler of the whole command).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys

from dpadapter.launch.prefork import FORWARDED, killed_message

ENV = "DPADAPTER_SUPERVISE"
_PR_SET_PDEATHSIG = 1


def supervise(argv: list[str]) -> None:
    """Fork: return in the child (which runs the job); the parent never returns (it exits with
    the child's status). Returns at once where switched off or where fork is unavailable."""
    if os.environ.get(ENV, "") == "0" or not hasattr(os, "fork"):
        return
    child = 0
    passed_on: list[int] = []

    def forward(signum: int, _frame) -> None:
        passed_on.append(signum)
        if child:  # 0 in the child, and in the parent before the fork returned
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signum)

    # before forking: a signal from then on is passed on (or queued until the child exists)
    previous = {s: signal.signal(s, forward) for s in FORWARDED}
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        child = os.fork()
    except OSError:  # no process to spare (a ulimit): the job runs here, unwatched as before
        for s, h in previous.items():
            signal.signal(s, h)
        for signum in passed_on:
            os.kill(os.getpid(), signum)
        return
    if child == 0:
        for s, h in previous.items():
            signal.signal(s, h)
        _detach_from_parent()
        return
    for signum in list(passed_on):  # arrived before the child existed
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signum)
    os._exit(_wait(child, argv, passed_on))


def _detach_from_parent() -> None:
    """The child's own session (signals reach it once, through the parent) and its death with
    the parent's (Linux; elsewhere a killed parent leaves the job running, as without this)."""
    with contextlib.suppress(OSError):
        os.setsid()
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the parent died before prctl took effect
        os._exit(128 + signal.SIGKILL)


def _wait(child: int, argv: list[str], passed_on: list[int]) -> int:
    """The child's exit status as a shell reports it; a SIGKILL nobody here sent is explained."""
    while True:
        try:
            _, status = os.waitpid(child, 0)
        except ChildProcessError:  # reaped elsewhere: nothing to report
            return 1
        if os.WIFEXITED(status):
            return os.WEXITSTATUS(status)
        if os.WIFSIGNALED(status):
            signum = os.WTERMSIG(status)
            if signum == signal.SIGKILL and not passed_on:
                print(killed_message(argv), file=sys.stderr, flush=True)
            return 128 + signum
