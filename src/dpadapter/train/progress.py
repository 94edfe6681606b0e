"""Progress lines for job logs: one per epoch, and one every few minutes inside long epochs.

Snakemake and Slurm send a job's stderr to its log file, where tqdm bars are switched off
(`loops.progress`); without these lines a multi-hour job's log stays empty until it ends. Each
line is self-contained (time stamp, job label, step, loss, validation accuracy, epsilon spent
and sigma where the job has them, elapsed and estimated remaining time), so `tail -f` on a
Slurm log, or `grep epoch` afterwards, tells what the job is doing. Written with `tqdm.write`,
which keeps the bars of an interactive terminal intact.
"""

from __future__ import annotations

import math
import sys
import time
from datetime import UTC, datetime
from typing import Any, TextIO

from tqdm.auto import tqdm

# Within an epoch, a line at most this often; an epoch that ends sooner prints only its own line.
STEP_LINE_EVERY_S = 120.0

# stats key -> (label in the line, format); in this order, each only when present and finite.
_FIELDS: tuple[tuple[str, str, str], ...] = (
    ("train_loss", "loss", "{:.4f}"),
    ("loss", "loss", "{:.4f}"),
    ("val_accuracy", "val_acc", "{:.4f}"),
    ("epsilon_spent", "eps", "{:.3f}"),
    ("noise_multiplier", "sigma", "{:.4f}"),
    ("delta_norm", "delta_norm", "{:.4f}"),
)


def hms(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    s = int(round(max(0.0, seconds)))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


class ProgressLine:
    """Prints progress of one training loop; the remaining time is extrapolated from the steps
    taken in this process (a resumed job does not count the steps it restored)."""

    def __init__(
        self,
        label: str,
        total_steps: int | None,
        start_step: int = 0,
        every_s: float = STEP_LINE_EVERY_S,
        stream: TextIO | None = None,
    ):
        self.label = label
        self.total = total_steps
        self.start_step = start_step
        self.every_s = every_s
        self.stream = stream
        self.t0 = time.monotonic()
        self.last = self.t0
        if start_step:
            self.emit(f"resumed at step {start_step}" + (f"/{self.total}" if self.total else ""))

    def emit(self, text: str) -> None:
        stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S")
        stream = self.stream if self.stream is not None else sys.stderr
        tqdm.write(f"{stamp} [{self.label}] {text}", file=stream)
        stream.flush()
        self.last = time.monotonic()

    def _timing(self, steps: int) -> str:
        elapsed = time.monotonic() - self.t0
        done = steps - self.start_step
        if self.total is None or done <= 0:
            eta = math.nan
        else:
            eta = elapsed / done * max(0, self.total - steps)
        return f"elapsed {hms(elapsed)} eta {hms(eta)}"

    def _steps(self, steps: int) -> str:
        return f"step {steps}" + (f"/{self.total}" if self.total else "")

    def step(self, steps: int, loss: float | None = None) -> None:
        """Called after every step; prints only when `every_s` has passed since the last line."""
        if time.monotonic() - self.last < self.every_s:
            return
        parts = [self._steps(steps)]
        if loss is not None and math.isfinite(loss):
            parts.append(f"loss {loss:.4f}")
        self.emit(" ".join([*parts, self._timing(steps)]))

    def epoch(self, epoch: int, epochs: int, stats: dict[str, Any], unit: str = "epoch") -> None:
        """The line of one finished epoch (or federated round: `unit`); `stats["steps"]` is
        the number of steps taken so far, of the `total_steps` this loop plans."""
        steps = int(stats.get("steps", 0))
        parts = [f"{unit} {epoch}/{epochs}", self._steps(steps)]
        seen = set()
        for key, name, fmt in _FIELDS:
            v = stats.get(key)
            if name in seen or not isinstance(v, int | float) or not math.isfinite(v):
                continue
            seen.add(name)
            parts.append(f"{name} {fmt.format(v)}")
        self.emit(" ".join([*parts, self._timing(steps)]))
