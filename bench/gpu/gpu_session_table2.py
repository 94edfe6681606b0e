"""DP-SAT Table 2 cells inside the GPU session: pre-train once, cells side by side, one summary.

The cells (Fashion-MNIST, GNResNet-10 from scratch, the paper's settings from
configs/dpsat-table2.yaml) run as the `finetune` stage's own processes, each into its own
folder, concurrently on the one GPU as far as its memory allows. A loan is short, so the table
is built over many: the cells finished in earlier loans are committed under `DONE`
(docs/gpu-runs/cells/, by `bench/gpu/gpu_runs.py collect`) and skipped, and a call runs the next
missing cells of `PLAN` (seed 0 of DP-SGD and DP-SAT at ε = 3 and 1 first, then their seeds 1
and 2, then DP-SAM and ε = 2, then seeds 3 and 4). The first two start at once; each further
cell starts only when the time measured so far says it will finish before the deadline (a
cell's duration grows with the cells sharing the GPU: the projection assumes the GPU is the
bottleneck, so k cells side by side each take k times as long). A cell
still running at the deadline is stopped and reported unfinished with how far it got; it never
appears as a result. `aggregate` and `reference` run once, over the finished cells.

A cell whose per-sample self-test refuses the session's mode on this device (the mode's clipped
sums disagree with the per-example reference: a device-only bug in that mode's kernels) is run
again at once in Opacus' hooks mode, which the self-test checks the same way, and reported with
the mode it ran in: a kernel bug in one mode then costs one cell's start, not the loan.
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import yaml
from gpu_session_run import Clock, Outcome, Proc, run, tail
from gpu_table2 import HEADER, cell_args, cell_line, paper_cell, pretrain_args, stage_command

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "dpsat-table2.yaml"
DONE = REPO / "docs" / "gpu-runs" / "cells" / CONFIG.stem  # cells finished in earlier loans
_FIRST_FOUR = (("dpsgd", 3.0), ("dpsat", 3.0), ("dpsgd", 1.0), ("dpsat", 1.0))
_ALL = tuple((a, e) for e in (3.0, 1.0, 2.0) for a in ("dpsgd", "dpsat", "dpsam"))
# every cell of the table (algorithm, ε, seed), in the order loans run them: the four at
# seed 0, their seeds 1 and 2 (three seeds each: mean ± std), DP-SAM and ε = 2 at seeds 0-2,
# then the paper's seeds 3 and 4 for all
PLAN = tuple(
    dict.fromkeys(
        [(a, e, seed) for seed in (0, 1, 2) for a, e in _FIRST_FOUR]
        + [(a, e, seed) for a, e in _ALL for seed in (0, 1, 2)]
        + [(a, e, seed) for seed in (3, 4) for a, e in _ALL]
    )
)
FIRST = 2  # the first two cells start without a projection
NEXT_SHOWN = 4  # cells not started that the report names (the rest are counted)
FALLBACK = "hooks"  # the mode a cell runs in after its self-test refused the session's mode
REFUSED = "PerSampleCheckError"  # in a cell's log: the self-test refused the mode
SUMMARY_S = 25.0  # kept for aggregate + reference at the end (dry run: DRY_SUMMARY_S)
DRY_SUMMARY_S = 12.0
PROGRESS = re.compile(r"step (\d+)/(\d+).*?elapsed (\d+):(\d\d):(\d\d) eta (\d+):(\d\d):(\d\d)")
# The dry run's tiny version of the paper's setting: same stages, sampling rule and summary.
DRY = {
    "model": {"name": "cnn-gn", "groups": 4, "width": 8},
    "public": {"n_train": 200, "n_test": 100},
    "tasks": {"fmnist": {"n_train": 400, "n_test": 200}},
    "finetune": {"epochs": 2, "batch_size": 100, "physical_batch_size": None},
}


def key(algo: str, eps: float, seed: int) -> str:
    return f"{algo}-eps{eps:g}-seed{seed}"


def collected(done: Path) -> dict[tuple[str, float, int], Path]:
    """Each cell with a committed result under `done`, and its
    <algo>/eps<e>/seed<s>/metrics.json (written last: its folder's marker of a finished cell)."""
    return {
        (m.parts[-4], float(m.parts[-3][3:]), int(m.parts[-2][4:])): m
        for m in done.glob("*/eps*/seed*/metrics.json")
    }


def finished(done: Path) -> set[tuple[str, float, int]]:
    """The cells with a committed result under `done`."""
    return set(collected(done))


def queue(done: Path) -> list[tuple[str, float, int]]:
    """The cells this call runs, in order: the plan minus what earlier loans finished."""
    have = finished(done)
    return [c for c in PLAN if c not in have]


def write_config(work: Path, mode: str, device: str, dry: bool, name: str = "table2") -> Path:
    """An overlay of the paper config: results under `work`, the session's mode and device."""
    overlay: dict = {
        "base": str(CONFIG),
        "results_dir": str(work / "results"),
        "device": device,
        "tracking": {"enabled": False},
        "finetune": {"grad_sample_mode": mode},
    }
    if dry:
        for section, values in DRY.items():
            if section == "tasks":
                overlay["tasks"] = values
            else:
                overlay[section] = {**overlay.get(section, {}), **values}
    path = work / f"{name}.yaml"
    work.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(overlay, sort_keys=False))
    return path


def progress(log: Path) -> tuple[int, int, float] | None:
    """(steps done, steps planned, projected total seconds) from the cell's last progress line."""
    hits = PROGRESS.findall(tail(log, 20000))
    if not hits:
        return None
    done, total, eh, em, es, th, tm, ts = map(int, hits[-1])
    elapsed = 3600 * eh + 60 * em + es
    return done, total, elapsed + 3600 * th + 60 * tm + ts


class Cells:
    """The cell queue: what runs, what finished, and the measured seconds per cell alone."""

    def __init__(
        self, config: Path, cfg, logs: Path, stall: set[str], parallel: int,
        mode: str = "bk", config_for=None, pending: list | None = None,
    ):  # fmt: skip
        self.config, self.cfg, self.logs = config, cfg, logs
        self.mode = mode
        # the config of a fallback mode, written when first needed
        self.config_for = config_for or (lambda mode: config)
        self.modes: dict[str, str] = {}  # key -> the mode it runs (ran) in
        self.retry: dict[str, str] = {}  # key -> the fallback mode it is queued again in
        self.stall, self.parallel = stall, max(1, parallel)
        # what this call runs, in order (`queue`: the plan less the cells already collected)
        self.pending: list[tuple[str, float, int]] = list(PLAN if pending is None else pending)
        self.cells: dict[str, tuple[str, float, int]] = {key(*c): c for c in PLAN}
        self.running: dict[str, tuple[Proc, int]] = {}  # key -> (process, cells beside it)
        self.outcomes: dict[str, Outcome] = {}
        self.alone_s: list[float] = []  # a cell's duration / the cells sharing the GPU
        self.last_est: float | None = None  # the last projection made while cells ran

    def command(self, algo: str, eps: float, seed: int, mode: str) -> tuple[Path, list[str]]:
        cell, args = cell_args(self.cfg, "scratch", "fmnist", algo, eps, seed)
        if key(algo, eps, seed) in self.stall:  # the dry run's stand-in for a cell that overruns
            return cell, [sys.executable, "-c", "import time; print('stalled'); time.sleep(3600)"]
        return cell, stage_command(self.config_for(mode), *args)

    def start(self, algo: str, eps: float, seed: int) -> None:
        k = key(algo, eps, seed)
        mode = self.modes[k] = self.retry.get(k, self.mode)
        _, cmd = self.command(algo, eps, seed, mode)
        log = self.logs / (f"table2-{k}.log" if mode == self.mode else f"table2-{k}-{mode}.log")
        self.running[k] = (Proc(k, cmd, log, None, None), 0)
        n = len(self.running)
        self.running = {name: (p, max(s, n)) for name, (p, s) in self.running.items()}

    def projection(self) -> float | None:
        """Seconds a new cell would take, started now beside the running ones."""
        alone = list(self.alone_s)
        for p, shared in self.running.values():
            got = progress(p.log)
            if got and got[0] > 0:
                alone.append(got[2] / shared)
        if not alone:
            return None
        return max(alone) * (len(self.running) + 1)

    def poll(self) -> None:
        for k, (p, shared) in list(self.running.items()):
            if p.poll() is not None:
                outcome = p.finish()
                del self.running[k]
                mode = self.modes.get(k, self.mode)
                if outcome.status == "failed" and mode != FALLBACK and REFUSED in tail(p.log):
                    self.retry[k] = FALLBACK  # first in the queue: it started before the rest
                    self.pending.insert(0, self.cells[k])
                    continue
                if mode != self.mode:
                    outcome.note = (
                        f"in {mode}: the self-test refused {self.mode} on this device "
                        f"(table2-{k}.log); {outcome.note}"
                    ).rstrip("; ")
                self.outcomes[k] = outcome
                if outcome.status == "passed":
                    self.alone_s.append(outcome.wall_s / shared)

    def schedule(self, end: float) -> None:
        while self.pending and len(self.running) < self.parallel:
            cell = self.pending[0]
            if len(self.outcomes) + len(self.running) >= FIRST and key(*cell) not in self.retry:
                est = self.projection()
                self.last_est = est or self.last_est
                if est is None or time.monotonic() + est > end:
                    return
            self.pending.pop(0)
            self.start(*cell)

    def stop_all(self, end_note: str) -> None:
        for k, (p, _) in self.running.items():
            p.stop()
            got = progress(p.log)
            how_far = f", step {got[0]}/{got[1]}" if got else ""
            self.outcomes[k] = p.finish(f"unfinished: {end_note}{how_far}")
        self.running = {}


def run_table2(
    work: Path, logs: Path, clock: Clock, mode: str, device: str, dry: bool,
    parallel: int, cap_s: float, stall: set[str], done: Path = DONE,
) -> dict:  # fmt: skip
    """Pre-train, the cells, the summary; returns what the session's report needs."""
    from dpadapter.validation.compose import load

    config = write_config(work, mode, device, dry)
    cfg = load(config)
    fallback: dict[str, Path] = {mode: config}

    def config_for(m: str) -> Path:
        if m not in fallback:
            fallback[m] = write_config(work, m, device, dry, name=f"table2-{m}")
        return fallback[m]

    summary_s = DRY_SUMMARY_S if dry else SUMMARY_S
    end = time.monotonic() + min(cap_s, clock.left()) - summary_s
    report: dict = {"config": str(config), "mode": mode, "parallel": parallel, "cells": {}}
    report["done_before"] = sorted(key(*c) for c in finished(done))
    report["done_from"] = str(done)
    ckpt, make = pretrain_args(cfg, "scratch")
    pre = run("table2-pretrain", stage_command(config, *make), logs / "table2-pretrain.log",
              clock, max(0.0, end - time.monotonic()))  # fmt: skip
    report["pretrain"] = vars(pre)
    cells = Cells(config, cfg, logs, stall, parallel, mode, config_for, queue(done))
    if pre.status == "passed":
        while cells.pending or cells.running:
            cells.poll()
            if time.monotonic() >= end:
                cells.stop_all("still running at the session's deadline")
                break
            cells.schedule(end)
            if not cells.running:
                break  # what is pending cannot finish in time
            time.sleep(0.5)
    report["not_started"] = len(cells.pending)
    for c in cells.pending[:NEXT_SHOWN]:  # the plan is long: the next few only
        # the running cells are stopped by now: their last projection says why
        est = cells.projection() or cells.last_est
        why = "projected " + (f"{est:.0f} s" if est else "an unknown time")
        cells.outcomes[key(*c)] = Outcome(
            key(*c), "skipped",
            note=f"not started: {why}, {max(0.0, end - time.monotonic()):.0f} s left",
        )  # fmt: skip
    results = Path(cfg.results_dir)
    ran = sorted((results / "finetune").rglob("metrics.json"))
    lines = [HEADER]
    for algo, eps, seed in (c for c in PLAN if key(*c) in cells.outcomes):
        k = key(algo, eps, seed)
        cell, _ = cell_args(cfg, "scratch", "fmnist", algo, eps, seed)
        o = cells.outcomes[k]
        entry = {**vars(o), "mode": cells.modes.get(k, mode)}
        metrics = cell / "metrics.json"
        if o.status == "passed" and metrics.is_file():
            m = json.loads(metrics.read_text())
            paper = paper_cell(cfg, algo, eps)
            entry.update(
                accuracy=100 * m["test_accuracy"],
                paper=None if paper is None else [paper.mean, paper.std],
                epsilon_spent=m["privacy"]["epsilon"],
                sigma=m["privacy"].get("noise_multiplier"),
                steps=m["privacy"]["steps"],
                peak_gpu_mib=m["device"].get("peak_memory_mib"),
            )
            lines.append(cell_line(m, paper))
        else:
            lines.append(f"| {algo} | {eps:g} | {seed} | {o.status}: {o.note} | | | | | | | |")
        report["cells"][k] = entry
    summary = results / "summary"
    if ran:
        agg = stage_command(
            config, "aggregate", "--metrics", *map(str, ran),
            "--pretrain", str(ckpt.parent / "metrics.json"),
            "--csv", str(summary / "finetune.csv"), "--md", str(summary / "finetune.md"),
        )  # fmt: skip
        ref = stage_command(
            config, "reference", "--finetune-csv", str(summary / "finetune.csv"),
            "--csv", str(summary / "reference.csv"), "--md", str(summary / "reference.md"),
        )  # fmt: skip
        for name, cmd in (("table2-aggregate", agg), ("table2-reference", ref)):
            o = run(name, cmd, logs / f"{name}.log", clock, summary_s / 2)  # the time kept
            report[name] = vars(o)
    report["table"] = "\n".join(lines) + "\n"
    ref_md = summary / "reference.md"
    report["reference_md"] = ref_md.read_text() if ref_md.is_file() else ""
    return report
