"""`python -m snakemake ...` for the tests, forked from a server that imported Snakemake once.

Why: the suite calls Snakemake's command line about 70 times (dry runs, refusals, the tiny
pipelines), and each fresh process spent ~1.3 s of its ~2.3 s of CPU importing Snakemake, its
executor plugins (the Slurm one imports pandas) and the workflow's light modules before
parsing anything (docs/measured.md, 2026-11-28, issue 46). The standard library's
`multiprocessing` forkserver imports them once per test worker (`PRELOAD`); each call forks a
child of that server, which takes the call's arguments, working folder and environment, runs
Snakemake's own command line (`snakemake.cli.main`), and hands back its exit status and its
standard streams: what a fresh `python -m snakemake` process would, without its imports.

The server forks from its only thread and never runs a workflow itself. What needs a process
of its own stays one: anything but `python -m snakemake` (the Slurm profile's wrapper, the
jobs), a call that does not capture its output as text, and every call where the forkserver
does not exist (not Linux) or `DPADAPTER_TEST_SNAKEMAKE_FORK=0` is set. The tests of the
parse's imports (tests/workflow/test_light_parse.py) keep their fresh process on purpose.
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import tempfile
from pathlib import Path

# What every Snakemake call imports before it reads the Snakefile: its command line, API,
# executors and plugins, and the modules the rule files import to validate the config; and what
# the parse of a config with external upstreams imports (torch, timm's pretrained configs:
# dpadapter.upstream.external), which the default config's parse does not
# (tests/workflow/test_light_parse.py holds it to that, in a fresh process). Measured
# 2026-11-28 (machine vm): a dry run of the Table 3 config took 4.4 s forked from a server
# without torch and timm, 1.4 s with them; the server starts about 3 s later, once per worker.
PRELOAD = (
    "snakemake.cli",
    "snakemake.api",
    "snakemake.executors.local",
    "snakemake.executors.dryrun",
    "snakemake.executors.touch",
    "snakemake_executor_plugin_slurm",
    "snakemake_interface_executor_plugins.registry",
    "snakemake_interface_storage_plugins.registry",
    "snakemake_interface_report_plugins.registry",
    "snakemake_interface_logger_plugins.registry",
    "dpadapter.settings",
    "dpadapter.validation",
    "yaml",
    "jsonschema",
    "torch",
    "timm",
    "dpadapter.upstream.external",
)
OFF = "DPADAPTER_TEST_SNAKEMAKE_FORK"
_context: multiprocessing.context.ForkServerContext | None = None


def _server() -> multiprocessing.context.ForkServerContext | None:
    global _context
    if (
        os.environ.get(OFF, "1") == "0"
        or "forkserver" not in multiprocessing.get_all_start_methods()
    ):
        return None
    if _context is None:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(list(PRELOAD))  # the server skips what it cannot import
        _context = ctx
    return _context


def _is_snakemake(cmd) -> bool:
    return list(cmd[:3]) == [sys.executable, "-m", "snakemake"]


def run(cmd: list[str], *, capture_output=False, text=False, env=None, cwd=None, timeout=None):
    """`subprocess.run(cmd, capture_output=True, text=True, ...)`, a Snakemake call forked
    from the server (module docstring); anything else as `subprocess.run` runs it."""
    ctx = _server() if capture_output and text and _is_snakemake(cmd) else None
    if ctx is None:
        return subprocess.run(
            cmd, capture_output=capture_output, text=text, env=env, cwd=cwd, timeout=timeout
        )
    args = [str(a) for a in cmd[3:]]
    folder = str(cwd) if cwd is not None else os.getcwd()
    environ = dict(os.environ if env is None else env)
    with tempfile.TemporaryDirectory(prefix="snakemake-call-") as tmp:
        out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
        out.touch()
        err.touch()
        child = ctx.Process(target=_child, args=(args, folder, environ, str(out), str(err)))
        child.start()
        child.join(timeout)
        if child.exitcode is None:
            child.kill()
            child.join()
            raise subprocess.TimeoutExpired(cmd, timeout, out.read_text(), err.read_text())
        return subprocess.CompletedProcess(cmd, child.exitcode, out.read_text(), err.read_text())


def _child(args: list[str], folder: str, environ: dict, out: str, err: str) -> None:
    """In the forked child: the call's folder, environment and streams, then Snakemake's own
    command line; its exit status is the child's."""
    os.chdir(folder)
    os.environ.clear()
    os.environ.update(environ)
    for fd, path in ((1, out), (2, err)):
        target = os.open(path, os.O_WRONLY | os.O_TRUNC)
        os.dup2(target, fd)
        os.close(target)
    import importlib.util

    from snakemake.cli import main

    # what `python -m snakemake` puts there (Snakemake prints it); its __main__ is not imported:
    # that runs the command line on import
    sys.argv = [importlib.util.find_spec("snakemake.__main__").origin, *args]
    code = 0
    try:
        main(args)
    except SystemExit as exc:  # as the interpreter ends on it: a message is printed, status 1
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    except BaseException:  # what the interpreter would print and exit 1 on
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)
