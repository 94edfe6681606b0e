"""Resume state of a training loop: one file outside the job's outputs, checked by identity.

Snakemake deletes a failed job's outputs, and a Slurm time limit or a node failure kills a job
without warning; so a loop's progress (model, optimizer, scheduler, every random stream) is
written atomically to `<results_dir>/.resume/<stage>/.../state.pt`, which Snakemake does not
know about. A retried job reads it back and continues where it stopped; the stage deletes it once
its outputs are written. `identity` is the repr of everything the run depends on (config
sections, the checkpoint it starts from): a state written for another configuration is ignored
with a warning, never mixed into this run. Torch has no such helper for a plain training loop
(torch.distributed.checkpoint saves state dicts, not a loop's position), so it is written here.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

from dpadapter.ground import atomic


def resume_file_path(results_dir: str | Path, *parts: str) -> Path:
    return Path(results_dir, ".resume", *parts, "state.pt")


class ResumeFile:
    """The resume state of one job; `state` is what an earlier attempt left (None if nothing)."""

    def __init__(self, path: str | Path, identity: str):
        self.path = Path(path)
        self.identity = identity
        self.extra: dict[str, Any] = {}  # saved with every state (e.g. the MLflow run id)
        self.state = self._read()

    def _read(self) -> dict[str, Any] | None:
        if not self.path.is_file():
            return None
        try:
            state = torch.load(self.path, map_location="cpu", weights_only=False)
        except Exception as exc:  # a state is only a shortcut: never fail a job over it
            print(
                f"warning: ignoring unreadable resume state {self.path} ({type(exc).__name__}); "
                "starting from the beginning",
                file=sys.stderr,
            )
            return None
        if not isinstance(state, dict) or state.get("identity") != self.identity:
            print(
                f"warning: ignoring resume state {self.path}: written for another configuration",
                file=sys.stderr,
            )
            return None
        return state

    def position(self) -> dict[str, int] | None:
        """Where the loop stopped: epochs completed, batches of the next one, steps in total."""
        if self.state is None:
            return None
        return {k: int(self.state[k]) for k in ("epoch", "batch", "steps") if k in self.state}

    def save(self, state: dict[str, Any]) -> None:
        # a kill during the write leaves the previous state intact
        atomic.torch_save({**state, **self.extra, "identity": self.identity}, self.path)

    def clear(self) -> None:
        self.path.unlink(missing_ok=True)
