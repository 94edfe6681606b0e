"""Jobs of a local run start from a process that has already imported torch, Opacus and MLflow.

A job of the default grid trains for a few seconds, and importing torch, Opacus and MLflow costs
about as long again in every one of its processes. Python shares imported modules between
processes only by `fork`, so a local `snakemake` run (never a cluster one) starts this server
(`workflow/rules/common.smk`, `onstart`), one per thread count that enough jobs ask for (the
fine-tuning jobs' one, warm-up's and pre-training's `workflow.cores`; native thread pools are
sized at import): it imports what jobs import, then waits on a Unix socket (a job that starts
while it imports waits for it). Each job's `python -m dpadapter ...` connects to the server of
its thread count (`delegate`), hands over its arguments, working folder, environment and
standard streams, and the server forks a child that runs the job exactly as the job's own
process would (`dpadapter.launch.cli.main`) and reports its exit status back. A signal the job's
process receives is passed on to the child; if that process is killed the child kills itself.

Like gunicorn's `--preload`, this relies on fork being safe after imports: the server never
runs a torch operation, opens no CUDA context, no MLflow store and no file a job writes, and
forks from its only Python thread.

Where it does not apply the job runs in its own process: no server (a cluster job, a dry run, a
stage run by hand), `DPADAPTER_PREFORK=0`, a job inside a Slurm allocation, or a server started
from another interpreter, copy of the package or thread count (checked on every connection).
A child computes what the job's own process computes (tests/launch/test_prefork.py compares the
outputs byte for byte); Snakemake's benchmark files still time the whole job, but their memory
and CPU columns see only the waiting process (`RESULTS/logs/prefork.log` lists each job run).

Hand-written: the standard library has the parts (`socket.send_fds`, `os.fork`) but no server.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import random
import signal
import socket
import struct
import sys
import tempfile
import threading
import time
from collections.abc import Collection
from pathlib import Path

# the servers' socket paths (`os.pathsep` between them); "0" or empty: run in-process
ENV = "DPADAPTER_PREFORK"
MIN_JOBS = 2  # jobs wait for a starting server: one import serves two (docs/measured.md)
STARTING = ".starting"  # beside the socket while the server imports: its pid (jobs wait)
STARTUP_WAIT_S = 120.0
_MAX_MESSAGE = 1 << 22
_STATUS = struct.Struct("!i")
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
# Imported once by the server: what the stages import; the optional ones where installed: what a
# tracked job imports beside MLflow (from sys.modules after a forked fine-tuning job, 0.7 s of
# each): GitPython for its source tags, tracing, the sqlite dialect, the store's schema check.
PRELOAD = (
    *("dpadapter.launch.cli", "dpadapter.stages.warmup", "dpadapter.stages.pretrain"),
    *("dpadapter.stages.finetune", "dpadapter.stages.aggregate", "dpadapter.stages.figures"),
    *("dpadapter.train.dp_fit", "dpadapter.tracking", "dpadapter.data.tensor_cache"),
    *("opacus", "opacus.utils.batch_memory_manager", "jsonschema"),
)
OPTIONAL_PRELOAD = (
    *("mlflow", "mlflow.store.tracking.sqlalchemy_store", "mlflow.tracing.processor.base_mlflow"),
    *("mlflow.tracing.export.utils", "sqlalchemy.dialects.sqlite", "alembic.command", "git"),
    "timm",
)
# Read once, when a native library loads (its thread pool's size) or the interpreter starts: a
# child cannot change them, so a job whose values differ from the server's runs in-process.
# Snakemake sets the thread variables to the rule's `threads` for every job.
THREAD_ENV = (
    "OMP_NUM_THREADS",
    "GOTO_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "MKL_NUM_THREADS",
    "VECLIB_MAXIMUM_THREADS",
    "NUMEXPR_NUM_THREADS",
)
# and OpenMP's wait policy, read when libgomp loads (how idle threads wait; docs/speed.md)
LOAD_TIME_ENV = (*THREAD_ENV, "OMP_WAIT_POLICY", "PYTHONHASHSEED")


def thread_env(threads: int | str) -> dict[str, str]:
    """The thread variables as Snakemake sets them for a job of `threads` threads."""
    return dict.fromkeys(THREAD_ENV, str(threads))


def _identity() -> dict[str, object]:
    """What must match between a job and the server for the child to be that job's process."""
    import dpadapter

    return {
        "executable": os.path.realpath(sys.executable),
        "package": dpadapter.__file__,
        "load_time_env": {k: os.environ.get(k) for k in LOAD_TIME_ENV},
    }


# --- the job's side ----------------------------------------------------------------------------


def server_for_this_job(value: str) -> str:
    """The socket of the server whose thread count is this job's (`$ENV` lists one socket per
    thread count, `os.pathsep` between them; `start` names each by its count), else the first.
    A job of another count is refused by the server it reaches (`_identity`) and runs here."""
    paths = [p for p in value.split(os.pathsep) if p]
    mine = os.environ.get(THREAD_ENV[0])
    return next((p for p in paths if _threads_of(p) == mine), paths[0] if paths else "")


def _threads_of(path: str) -> str | None:
    name = os.path.basename(path)
    if name.startswith("jobs-t") and name.endswith(".sock"):
        return name[len("jobs-t") : -len(".sock")]
    return "1" if name == "jobs.sock" else None


def delegate(argv: list[str]) -> int | None:
    """Run `python -m dpadapter argv` in a child of the server; None: run it here instead."""
    path = server_for_this_job(os.environ.get(ENV, ""))
    if path in ("", "0") or os.environ.get("SLURM_JOB_ID"):
        return None
    _wait_while_starting(path)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    pending: list[int] = []

    def forward(signum: int, _frame) -> None:
        pending.append(signum)
        _send_signal(conn, signum)

    # before connecting: a signal from then on reaches the child (queued until it runs), or
    # this process if the job ends up running here
    previous = {s: signal.signal(s, forward) for s in FORWARDED}
    try:
        conn.connect(path)
        message = {"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ), "path": sys.path}
        message.update(_identity())
        socket.send_fds(conn, [json.dumps(message).encode()], [0, 1, 2])
        answer = conn.recv(1)
        accepted = answer == b"+"  # else refused: another interpreter or package, or a hazard
        if answer == b"-":
            reason = _read_reason(conn)
            if reason:
                print(
                    f"dpadapter: the fork server refused this job ({reason}); "
                    "it runs in its own process",
                    file=sys.stderr,
                    flush=True,
                )
    except OSError:  # no server (gone, never started): this process runs the job
        accepted = False
    if not accepted:
        conn.close()
        for s, h in previous.items():
            signal.signal(s, h)
        for signum in pending:
            os.kill(os.getpid(), signum)
        return None
    try:
        data = b""
        while len(data) < _STATUS.size:
            chunk = conn.recv(_STATUS.size - len(data))
            if not chunk:
                print("dpadapter: the job's process ended without a status", file=sys.stderr)
                return 1
            data += chunk
        code = _STATUS.unpack(data)[0]
        if code == 128 + signal.SIGKILL and not pending:
            print(killed_message(argv), file=sys.stderr, flush=True)
        return code
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        conn.close()


def killed_message(argv: list[str]) -> str:
    """Why a job died of SIGKILL that nobody sent it (the kernel's out-of-memory killer, as a
    rule), and what to change; the settings are read from the job's own config file."""
    where = ""
    with contextlib.suppress(ValueError, OSError, IndexError):
        ft = json.loads(Path(argv[argv.index("--config") + 1]).read_text()).get("finetune", {})
        where = f" (finetune.grad_sample_mode: {ft.get('grad_sample_mode', 'bk')}, "
        where += f"batch_size: {ft.get('batch_size')}, "
        where += f"physical_batch_size: {ft.get('physical_batch_size')})"
    i = argv.index("--config") + 2 if "--config" in argv else len(argv)
    stage = argv[i] if i < len(argv) else "the job"
    return (
        f"dpadapter: {stage} was killed by SIGKILL, which nothing in the pipeline sends: most "
        f"likely the kernel's out-of-memory killer{where}. Per-sample gradients cost the most "
        "memory: use finetune.grad_sample_mode: bk (no per-example gradients for most layers) "
        "and a smaller finetune.physical_batch_size (the same logical batch in more passes), or "
        "give the job more memory (docs/cluster.md: sizing mem_mb)"
    )


def _read_reason(conn: socket.socket) -> str:
    """What the server said after refusing (empty for an identity mismatch, which is silent)."""
    conn.settimeout(5.0)
    data = b""
    with contextlib.suppress(OSError):
        while chunk := conn.recv(4096):
            data += chunk
    return data.decode(errors="replace").strip()


def _wait_while_starting(path: str) -> None:
    """A job that starts while the server imports waits for it: importing in parallel would cost
    the job as long, and the CPU the server needs (`STARTING`; a dead server is not waited for)."""
    deadline = time.monotonic() + STARTUP_WAIT_S
    while not os.path.exists(path) and time.monotonic() < deadline and _starting(path):
        time.sleep(0.05)


def _starting(path: str) -> bool:
    """Whether the server of `path` is still importing: its `STARTING` marker names a live pid."""
    try:
        return _alive(int(Path(path + STARTING).read_text()))
    except (OSError, ValueError):
        return False


def _send_signal(conn: socket.socket, signum: int) -> None:
    try:
        conn.sendall(bytes([signum]))
    except OSError:
        pass


# --- the server's side ---------------------------------------------------------------------------


def serve(path: str, parent: int, idle_seconds: float) -> None:
    """Import, then fork a child per connection until `parent` is gone or nothing came for
    `idle_seconds`; the socket appears only once the imports are done (the `STARTING` marker
    goes then, or when the server fails: waiting jobs then run on their own)."""
    try:
        _serve(path, parent, idle_seconds)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path + STARTING)


def _serve(path: str, parent: int, idle_seconds: float) -> None:
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    for name in OPTIONAL_PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    # What the imports made lives as long as the server and every child: out of the collector's
    # reach (Python's advice for fork servers). Else each child's first full collection walks
    # all ~670,000 of them, about 0.35 s of a tiny job (and copies their pages: copy-on-write).
    gc.collect()
    gc.freeze()
    me = _identity()
    sys.stdout.flush()
    sys.stderr.flush()
    tmp = f"{path}.{os.getpid()}.tmp"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(tmp)
    os.chmod(tmp, 0o600)
    listener.listen(64)
    os.replace(tmp, path)
    with contextlib.suppress(OSError):
        os.unlink(path + STARTING)
    listener.settimeout(1.0)
    print(
        f"{time.strftime('%H:%M:%S')} serving at {path}: {_native_threads()} threads "
        f"(1 Python thread), CUDA initialised: {_cuda_initialised()}, "
        f"{gc.get_freeze_count()} objects frozen",
        flush=True,
    )
    children: dict[int, socket.socket] = {}
    last = time.monotonic()
    try:
        while children or (
            _alive(parent) and os.path.exists(path) and time.monotonic() - last < idle_seconds
        ):
            _reap(children)
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            last = time.monotonic()
            conn.settimeout(None)
            try:
                raw, fds, _, _ = socket.recv_fds(conn, _MAX_MESSAGE, 3)
                message = json.loads(raw)
            except (OSError, ValueError):
                conn.close()
                continue
            hazard = None if len(fds) != 3 else fork_hazard()
            if len(fds) != 3 or any(message.get(k) != v for k, v in me.items()) or hazard:
                for fd in fds:
                    os.close(fd)
                if hazard:
                    print(f"{time.strftime('%H:%M:%S')} refused: {hazard}", flush=True)
                with contextlib.suppress(OSError):
                    conn.sendall(b"-" + (hazard or "").encode())
                conn.close()
                continue
            pid = os.fork()
            if pid == 0:
                listener.close()
                for other in children.values():
                    other.close()
                _child(conn, fds, message)  # never returns
            for fd in fds:
                os.close(fd)
            children[pid] = conn
            print(f"{time.strftime('%H:%M:%S')} pid {pid}: {' '.join(message['argv'])}", flush=True)
    finally:
        listener.close()
        stop(path)


def fork_hazard() -> str | None:
    """Why forking now would give a child a broken process, or None when it is safe: a CUDA
    context does not survive fork, and a lock another Python thread holds stays held for ever
    in the child. Checked before every fork (a preloaded module or a future edit could break
    either). Native threads started at import (torch's, jemalloc's) hold no lock a job takes."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return (
            f"CUDA is initialised in the fork server (pid {os.getpid()}); a forked job could "
            "not use the GPU. Nothing the server imports may touch CUDA (dpadapter.launch.prefork)"
        )
    others = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    if others:
        return (
            f"the fork server runs {len(others) + 1} Python threads ({', '.join(others)}), "
            "and fork copies only one; it must stay single-threaded (dpadapter.launch.prefork)"
        )
    return None


def _cuda_initialised() -> bool:
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_initialized())


def _native_threads() -> int:
    with contextlib.suppress(OSError):
        return len(os.listdir("/proc/self/task"))
    return -1


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        pass
    return True


def _reap(children: dict[int, socket.socket]) -> None:
    """Collect ended children; one killed by a signal had no chance to report, so say it here."""
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is None:
            continue
        if os.WIFSIGNALED(status):
            with contextlib.suppress(OSError):
                conn.sendall(_STATUS.pack(128 + os.WTERMSIG(status)))
        conn.close()


def _child(conn: socket.socket, fds: list[int], message: dict) -> None:
    code = 1
    try:
        for fd, target in zip(fds, (0, 1, 2), strict=True):
            os.dup2(fd, target)
            os.close(fd)
        for s in (*FORWARDED, signal.SIGCHLD):
            signal.signal(s, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.chdir(message["cwd"])
        os.environ.clear()
        os.environ.update(message["env"])
        sys.path[:] = message.get("path", sys.path)  # the job's own process's, not the server's
        tempfile.tempdir = None  # chosen again from the job's TMPDIR
        _reseed_globals()
        sys.argv = [sys.argv[0], *message["argv"]]
        conn.sendall(b"+")
        threading.Thread(target=_watch, args=(conn,), daemon=True).start()
        code = _run(message["argv"])
    finally:
        try:
            conn.sendall(_STATUS.pack(code))
        finally:
            os._exit(code)


def _reseed_globals() -> None:
    """Fresh OS entropy for the global `random`, numpy and torch generators of this job, as its
    own process would have (a child inherits the server's state; CPython reseeds `random`
    after a fork, numpy does not)."""
    random.seed()
    numpy = sys.modules.get("numpy")  # not imported yet: seeded from the OS when it is
    if numpy is not None:
        numpy.random.seed()
    torch = sys.modules.get("torch")  # a fresh process seeds it from the OS too
    if torch is not None:
        torch.seed()


def _run(argv: list[str]) -> int:
    """The job, as `dpadapter.__main__` runs it: its status, or 1 with the traceback."""
    import traceback

    from dpadapter.launch.cli import main

    try:
        rc = main(argv)
        code = rc if isinstance(rc, int) else (0 if rc is None else 1)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    finish_process()
    return code


def finish_process() -> None:
    """What a normal exit does with an effect outside the process, for one that then ends with
    `os._exit` (`dpadapter.__main__`, a child here): non-daemon threads joined, `atexit`
    handlers run (MLflow flushes there), standard streams flushed."""
    import atexit

    for t in threading.enumerate():
        if t is not threading.main_thread() and not t.daemon:
            t.join()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()


def _watch(conn: socket.socket) -> None:
    """Signals the job's process passes on are raised here; its end (killed) ends the child."""
    while True:
        try:
            data = conn.recv(64)
        except OSError:
            data = b""
        if not data:
            os.kill(os.getpid(), signal.SIGKILL)
            return
        for signum in data:
            os.kill(os.getpid(), signum)


# --- the workflow's side ----------------------------------------------------------------------


def start(
    python: str, log: str | Path, threads: int = 1, idle_seconds: float = 900.0
) -> str | None:
    """Start a server for this Snakemake process (its parent) whose environment is a job's with
    `threads` threads (Snakemake's variables); its socket path (in a fresh private temporary
    folder: a Unix socket path must be short, named by `threads` for `server_for_this_job`),
    or None where `DPADAPTER_PREFORK=0`."""
    import subprocess

    if os.environ.get(ENV, None) == "0":
        return None
    name = "jobs.sock" if threads == 1 else f"jobs-t{threads}.sock"
    path = str(Path(tempfile.mkdtemp(prefix="dpadapter-")) / name)
    Path(log).parent.mkdir(parents=True, exist_ok=True)
    log = open(log, "ab")  # noqa: SIM115 (the server's own; closed here once handed over)
    server = subprocess.Popen(
        [python, "-m", "dpadapter.launch.prefork", path, str(os.getpid()), str(idle_seconds)],
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={
            **{k: v for k, v in os.environ.items() if k != ENV},
            **thread_env(threads),
        },
    )
    log.close()
    Path(path + STARTING).write_text(str(server.pid))
    return path


def inherited(value: str | None, threads: Collection[int]) -> str | None:
    """`value` (`$ENV` as this run found it) where its servers serve every count in `threads`
    and each is up or starting: servers a parent process started for many runs (a test
    session's, tests/conftest.py), which a run uses instead of importing again in its own.
    None: the run starts its own. A job of a count they lack, or of another copy of the
    package, is refused by the server it reaches and runs in its own process, as ever."""
    paths = [p for p in (value or "").split(os.pathsep) if p and p != "0"]
    live = {_threads_of(p) for p in paths if os.path.exists(p) or _starting(p)}
    return value if paths and {str(k) for k in threads} <= live else None


def stop(path: str | None) -> None:
    """Remove the socket (each of `$ENV`'s): new jobs run in-process, each server leaves when
    its children have."""
    for one in (path or "").split(os.pathsep):
        if not one or one == "0":
            continue
        for leftover in (one, one + STARTING):
            with contextlib.suppress(OSError):
                os.unlink(leftover)
        with contextlib.suppress(OSError):
            os.rmdir(os.path.dirname(one))


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]))
