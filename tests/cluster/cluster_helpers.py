"""Helpers for the cluster tests: system packages, daemons we start and stop, tiny workdirs.

Every process a test starts is started in its own session and stopped by its PID (then any
process left in that session, by PID too); nothing here signals a process it did not start.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
APT_LOCK = Path("/tmp/dpadapter-tests-apt.lock")


def tiny_workdir(path: Path, raw: dict) -> Path:
    """A Snakemake working directory holding only `config.yaml` (the tiny synthetic config)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def job_env(workdir: Path, **extra: str) -> dict[str, str]:
    """Environment of a pipeline run: the venv first on PATH, MLflow in the workdir, 1 thread."""
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SNAKEMAKE_"))
    }
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '/usr/bin:/bin')}"
    env["MLFLOW_TRACKING_URI"] = f"sqlite:///{workdir / 'mlruns.db'}"
    env.setdefault("DPADAPTER_THREADS", "1")
    env.update(extra)
    return env


@contextlib.contextmanager
def file_lock(path: Path, timeout_s: float) -> Iterator[bool]:
    """Exclusive lock on `path`, waiting at most `timeout_s`; yields whether it was acquired."""
    with open(path, "a") as fh:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    yield False
                    return
                time.sleep(0.5)
        try:
            yield True
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def ensure_debian_packages(packages: list[str], binaries: list[str]) -> str | None:
    """Install Debian packages when a binary is missing; None when usable, else why not.

    Needs root and apt-get; installs nothing when every binary is already there (a CI cache or
    an earlier run), so after the first time this costs nothing.
    """
    if all(shutil.which(b) for b in binaries):
        return None
    if not shutil.which("apt-get"):
        return f"{', '.join(binaries)} missing and apt-get is not available"
    if os.geteuid() != 0:
        return f"{', '.join(binaries)} missing and installing {' '.join(packages)} needs root"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    with file_lock(APT_LOCK, timeout_s=900) as locked:
        if not locked:
            return "another test process holds the apt lock for too long"
        if all(shutil.which(b) for b in binaries):
            return None
        apt = ["apt-get", "-o", "DPkg::Lock::Timeout=300", "-q", "-y"]
        steps = [[*apt, "update"], [*apt, "install", "--no-install-recommends", *packages]]
        for cmd in steps:
            r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
            if r.returncode != 0:
                tail = (r.stdout + r.stderr).strip().splitlines()[-3:]
                return f"`{' '.join(cmd)}` failed: {' | '.join(tail)}"
    missing = [b for b in binaries if not shutil.which(b)]
    return f"installed {packages} but still missing {missing}" if missing else None


def require_debian_packages(packages: list[str], binaries: list[str]) -> None:
    reason = ensure_debian_packages(packages, binaries)
    if reason:
        pytest.skip(reason)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_in_use(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def start_daemon(cmd: list[str], log: Path, **kwargs) -> subprocess.Popen:
    """Start `cmd` in a new session (so its children can be found and stopped by PID)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        return subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            **kwargs,
        )


def session_members(sid: int) -> list[int]:
    """PIDs of the live processes in session `sid` (i.e. started by the daemon we started)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if os.getsid(int(entry.name)) == sid and _alive(int(entry.name)):
                    pids.append(int(entry.name))
    return pids


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def stop_daemon(proc: subprocess.Popen, timeout_s: float = 30) -> None:
    """SIGTERM the process we started, then SIGKILL it and whatever it left in its session."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    deadline = time.monotonic() + 10
    while (left := session_members(proc.pid)) and time.monotonic() < deadline:
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM if time.monotonic() < deadline - 5 else signal.SIGKILL)
        time.sleep(0.5)
    for pid in session_members(proc.pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def wait_until(
    predicate, timeout_s: float, what: str, interval_s: float = 0.5, log: Path | None = None
):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    detail = f"\n--- {log} ---\n{log.read_text()[-3000:]}" if log and log.exists() else ""
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}{detail}")


def run_in_session(cmd: list[str], timeout_s: float, **kwargs) -> tuple[int, str, str]:
    """Run `cmd` in its own session; whatever it leaves running afterwards is stopped by PID."""
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
        text=True,
        errors="replace",
        **kwargs,
    )
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        err += f"\n[timed out after {timeout_s:.0f}s]"
    finally:
        stop_daemon(proc, timeout_s=5)
    return proc.returncode, out, err
