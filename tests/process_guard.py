"""The two test tiers, and the check that keeps the fast one in-process.

`make check` runs the tests marked neither `process` (starts a process) nor `slow` (in-process
but too long for the edit loop; also the older end-to-end Snakemake tests), for the edit loop;
`make test` runs everything. The fast tier's promise is that none of its tests starts a process
(Snakemake, Slurm, DVC, torchrun, a server, a fork server, any subprocess): a test that does so
unmarked fails, whichever command runs it, naming the marker to add. Without the check the
marker would rot: a new end-to-end test left unmarked would silently lengthen the edit loop.

Every way this Python starts a process ends in one of the functions wrapped here
(`subprocess.Popen` for `subprocess.run`, `os.popen` and asyncio; `_posixsubprocess.fork_exec`
for multiprocessing's spawn start and its fork server's own start, the fork server's
`connect_to_new_process` for a start through a fork server already running; `os.fork` for
its fork start, `os.spawn*` and `pty.fork`). The wrappers are installed once and refuse only
while a guarded test runs.
"""

from __future__ import annotations

import _posixsubprocess
import functools
import multiprocessing.forkserver
import os
import platform
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest

MARKER = "process"
# the markers that put a test in `make test` only (`make check`: -m "not process and not slow")
FULL_TIER_ONLY = (MARKER, "slow")
HELP = (
    f"mark it @pytest.mark.{MARKER} (or the module: pytestmark = pytest.mark.{MARKER}); "
    "`make check` runs only in-process tests (tests/process_guard.py)"
)

# Lookups a library makes by a process once and then keeps, for every later caller in the
# process: which test came first would otherwise decide which one fails. (file, function) of
# the caller that keeps the answer.
ONCE_PER_PROCESS = (
    # MLflow's git tags of a run (`git version`, `git check-ignore`), kept by its run context
    (os.path.join("mlflow", "tracking", "context", "git_context.py"), "_resolve_git_info"),
)

# (node id, what it started) of the test under guard, while one is; a refusal caught by the
# test's own code stays seen there
_guarded: list[tuple[str, list[str]]] = []


def in_full_tier_only(item: pytest.Item) -> bool:
    return any(item.get_closest_marker(m) is not None for m in FULL_TIER_ONLY)


def _refuse(what: str, describe: Callable[..., str] | None = None):
    def wrap(original):
        @functools.wraps(original)
        def refusing(*args, **kwargs):
            if not _guarded or _once_per_process():
                return original(*args, **kwargs)
            detail = describe(*args, **kwargs) if describe else ""
            nodeid, caught = _guarded[-1]
            message = f"{nodeid} started a process ({what}{detail}): {HELP}"
            caught.append(message)
            pytest.fail(message, pytrace=True)  # a BaseException: `except Exception` passes it

        refusing.__process_guard__ = True
        return refusing

    return wrap


def _once_per_process() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        if any(code.co_filename.endswith(f) and code.co_name == n for f, n in ONCE_PER_PROCESS):
            return True
        frame = frame.f_back
    return False


def _popen_args(self, args, *rest, **kwargs) -> str:
    argv = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args)
    return f": {' '.join(str(a) for a in argv)[:200]}"


_TARGETS = (
    (subprocess.Popen, "_execute_child", "subprocess.Popen", _popen_args),
    (_posixsubprocess, "fork_exec", "_posixsubprocess.fork_exec", None),
    # a fork server already running (started by an earlier test in this worker) forks the child
    # itself: the request is the start
    (
        multiprocessing.forkserver,  # the module's name for its server's bound method
        "connect_to_new_process",
        "multiprocessing's fork server",
        None,
    ),
    (os, "fork", "os.fork", None),
    (os, "forkpty", "os.forkpty", None),
    (os, "posix_spawn", "os.posix_spawn", None),
    (os, "posix_spawnp", "os.posix_spawnp", None),
    (os, "system", "os.system", lambda cmd: f": {cmd}"),
)


def install() -> None:
    """Wrap every process-starting function (once per process; refusing nothing until
    `guarding`), after the process-wide answers that libraries get from a process once and
    keep (as `ONCE_PER_PROCESS`)."""
    platform.processor()  # `uname -p`, kept by `platform.uname()`; asked during a training run
    for owner, name, what, describe in _TARGETS:
        original = getattr(owner, name, None)
        if original is not None and not getattr(original, "__process_guard__", False):
            setattr(owner, name, _refuse(what, describe)(original))


@contextmanager
def guarding(nodeid: str) -> Iterator[None]:
    """Refuse every process start inside; fail afterwards if one was started (and refused)
    even where the code under test caught the refusal, or it happened in another thread."""
    caught: list[str] = []
    _guarded.append((nodeid, caught))
    try:
        yield
    finally:
        _guarded.pop()
    if caught:
        pytest.fail(caught[0], pytrace=False)
