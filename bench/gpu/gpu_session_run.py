"""Running the session's steps under one deadline (bench/gpu/gpu_session.py's machinery).

Every step and every Table 2 cell is a process of its own, in a process group of its own, with
its output in its own log. A process still running when its time is up (its step's cap, or the
session's deadline less the time kept for writing the files) is stopped, SIGTERM then SIGKILL
to the whole group, and reported as cut: what it wrote before stays and is read like any other
output, but nothing it did not finish is reported as a result.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import time
from pathlib import Path

# Kept free at the end of the session: packing the files and writing the summary.
RESERVE_S = 12.0
# Below this, a step is not started at all (it could not finish anything worth reading).
MIN_START_S = 4.0
KILL_GRACE_S = 5.0


@dataclasses.dataclass
class Outcome:
    """What one step or cell did: passed, failed (rc != 0), cut (time up) or skipped."""

    name: str
    status: str
    wall_s: float = 0.0
    rc: int | None = None
    note: str = ""
    log: str | None = None


class Clock:
    """The session's deadline, on the monotonic clock."""

    def __init__(self, seconds: float):
        self.start = time.monotonic()
        self.deadline = self.start + seconds

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def left(self) -> float:
        """Seconds a step may still use: the deadline less the reserve for the files."""
        return self.deadline - RESERVE_S - time.monotonic()


class Proc:
    """One process of the session, started at once, stopped by `stop` or at its own end."""

    def __init__(self, name: str, cmd: list[str], log: Path, env: dict | None, cwd: Path | None):
        self.name, self.log = name, log
        log.parent.mkdir(parents=True, exist_ok=True)
        self._fh = open(log, "wb")  # noqa: SIM115 (closed in finish)
        self._fh.write(("+ " + " ".join(map(str, cmd)) + "\n").encode())
        self._fh.flush()
        self.t0 = time.monotonic()
        self.p = subprocess.Popen(
            [str(c) for c in cmd],
            stdout=self._fh,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=cwd,
            start_new_session=True,  # its own group: a stop reaches its children too
        )
        self.cut = False

    def poll(self) -> int | None:
        return self.p.poll()

    def stop(self) -> None:
        """SIGTERM to the group, SIGKILL after a grace period: a deadline is a deadline."""
        if self.p.poll() is not None:
            return
        self.cut = True
        for sig, wait in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, 30.0)):
            try:
                os.killpg(self.p.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.p.wait(wait)
                break
            except subprocess.TimeoutExpired:
                continue

    def finish(self, note: str = "") -> Outcome:
        rc = self.p.poll()
        self._fh.close()
        wall = round(time.monotonic() - self.t0, 1)
        if self.cut:
            status = "cut"
            note = note or f"stopped at its time limit after {wall:.0f} s"
        else:
            status = "passed" if rc == 0 else "failed"
        return Outcome(self.name, status, wall, rc, note, str(self.log))


def run(
    name: str,
    cmd: list[str],
    log: Path,
    clock: Clock,
    cap_s: float,
    env: dict | None = None,
    cwd: Path | None = None,
) -> Outcome:
    """Run `cmd` to its end, its cap or the session's deadline, whichever comes first."""
    budget = min(cap_s, clock.left())
    if clock.left() < MIN_START_S:
        return Outcome(name, "skipped", note=f"not started: {max(0.0, clock.left()):.0f} s left")
    proc = Proc(name, cmd, log, env, cwd)
    try:
        proc.p.wait(budget)
    except subprocess.TimeoutExpired:
        proc.stop()
        why = "the session's deadline" if budget < cap_s else f"its cap of {cap_s:.0f} s"
        return proc.finish(f"cut at {why} after {time.monotonic() - proc.t0:.0f} s")
    return proc.finish()


def tail(path: str | Path | None, limit: int = 6000) -> str:
    """The end of a log, for the summary and logs.txt."""
    if not path or not Path(path).is_file():
        return ""
    data = Path(path).read_bytes()
    text = data[-limit:].decode(errors="replace")
    return ("…" if len(data) > limit else "") + text
