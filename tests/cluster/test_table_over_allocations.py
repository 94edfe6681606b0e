"""A Table-2-like config accumulated over short allocations, as a cluster researcher runs it.

The first `snakemake` call ("allocation") is cut by a time limit in the middle of one
fine-tuning job: Slurm sends SIGTERM to every process of the job, as here (each job is its own
process, as on a cluster: no prefork server). With `--keep-going` the other job finishes;
`snakemake table_so_far` then prints the published table with the finished cell beside the
paper's number and the cut one marked with the epoch it resumes after. The same `snakemake`
call again ("next allocation") runs only the cut job, which resumes from its resume state:
its privacy ledger continues (every release counted once, none lost: the epsilon, history and
weights of an uninterrupted run of the same job), and the full table appears.
"""

from __future__ import annotations

import csv
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import snakemake_runner  # tests/ is on sys.path
import torch
from cluster_helpers import REPO, job_env, stop_daemon, tiny_workdir

EPOCHS = 5
STEPS_PER_EPOCH = 20  # n_train 1000, expected batch 50
CELL = "scratch/syn-shift/{algo}/eps3/seed0"
VICTIM = CELL.format(algo="dpsat")
FINISHED = CELL.format(algo="dpsgd")
PAPER = {"dpsgd": (84.55, 0.17), "dpsat": (85.91, 0.22)}  # DP-SAT Table 2, FashionMNIST, eps 3


def _raw(tiny_raw: dict) -> dict:
    raw = tiny_raw
    raw["pretrain"]["methods"] = ["scratch"]
    raw["tasks"] = {"syn-shift": {**raw["tasks"]["syn-shift"], "n_train": 1000}}
    raw["finetune"].update(
        algorithms=["dpsgd", "dpsat"], epsilons=[3], seeds=[0], upstreams=["scratch"],
        epochs=EPOCHS, algo_params={"dpsat": {"rho": 0.03}},
    )  # fmt: skip
    raw["privacy"]["accountant"] = "rdp"  # as configs/dpsat-table2.yaml
    # MLflow off: its import and sqlite store would cost seconds a job; a resumed job going on
    # in its MLflow run is tested in test_resume_sigkill.py (SIGTERM ends a job either way)
    raw["tracking"]["enabled"] = False
    raw["reference"] = {
        "name": "Tiny Table 2",
        "source": "DP-SAT Table 2's FashionMNIST numbers at eps 3, beside a synthetic task",
        "upstream": "scratch",
        "task": "syn-shift",
        "baseline": "dpsgd",
        "improved": "dpsat",
        "cells": [
            {"algorithm": a, "epsilon": 3, "mean": m, "std": s} for a, (m, s) in PAPER.items()
        ],
    }
    return raw


def _snakemake(wd: Path, *targets: str) -> list[str]:
    return [
        sys.executable, "-m", "snakemake", "--snakefile", str(REPO / "Snakefile"),
        "--directory", str(wd), "--cores", "2", "--keep-going", *targets,
    ]  # fmt: skip


# What Snakemake sets for a job of `threads: 1`. A job's numbers depend on them (about 1e-9 in
# the first epoch's loss here, which DP-SAT's steps amplify), so the uninterrupted run of the
# cut job, started by hand, gets them too.
SNAKEMAKE_THREADS_ENV = {
    k: "1"
    for k in ("OMP_NUM_THREADS", "GOTO_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
              "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS")
}  # fmt: skip


def _env(wd: Path, **extra: str) -> dict[str, str]:
    # each job its own process, as on a cluster
    return job_env(wd, DPADAPTER_PREFORK="0", **extra)


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _job_processes(root: int, algo: str) -> list[int]:
    """The processes of one fine-tuning job under Snakemake: its shell, `python -m dpadapter`
    and the child that trains (dpadapter.launch.supervise)."""
    found = []
    for pid in _descendants(root):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        except OSError:
            continue
        text = " ".join(argv)
        if " finetune " in f" {text} " and f"--algo {algo} " in text:
            found.append(pid)
    return found


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _job_counts(out: str) -> dict[str, int]:
    stats = out.split("Job stats:", 1)[1].split("\n\n", 1)[0]
    return {k: int(v) for k, v in re.findall(r"^(\w+)\s+(\d+)\s*$", stats, re.M)}


@pytest.mark.slow
def test_a_table_accumulates_over_allocations_and_a_cut_job_resumes(tiny_raw, tmp_path):
    wd = tiny_workdir(tmp_path / "wd", _raw(tiny_raw))
    res = wd / "results"
    state = res / ".resume" / "finetune" / VICTIM / "state.pt"
    victim_out, finished_out = res / "finetune" / VICTIM, res / "finetune" / FINISHED

    # --- first allocation: cut by its time limit once the dpsat job has saved its first epoch
    log1 = tmp_path / "snakemake-1.log"
    with open(log1, "w") as fh:
        first = subprocess.Popen(
            _snakemake(wd), cwd=wd, env=_env(wd), stdout=fh, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
    try:
        # the job's processes (its shell, `python -m dpadapter` and the child that trains),
        # found before its first epoch ends: its epochs take a fraction of a second here
        deadline = time.monotonic() + 240
        victims: list[int] = []
        while len(victims) < 3 and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
            victims = _job_processes(first.pid, "dpsat")
        assert len(victims) == 3 and not state.exists(), (victims, log1.read_text()[-3000:])
        while not state.exists() and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.002)
        assert state.exists(), f"no resume state of {VICTIM}:\n{log1.read_text()[-3000:]}"
        assert all(map(_alive, victims)), "the dpsat job ended before it could be cut"
        # held where it is at once, then Slurm's time limit: SIGTERM to every process of the
        # job ...
        for sig in (signal.SIGSTOP, signal.SIGTERM, signal.SIGCONT):
            for pid in victims:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    # stopped, none can end before its SIGCONT; once continued, one may end on
                    # its SIGTERM and take a child along (supervise) before that child's turn
                    assert sig == signal.SIGCONT, (pid, sig)
        t_term = time.monotonic()
        while any(map(_alive, victims)) and time.monotonic() < t_term + 30:
            time.sleep(0.05)
        # ... and SIGKILL after KillWait (30 s): the job ended on SIGTERM alone, well before
        assert not any(map(_alive, victims)), "the job did not end on SIGTERM within 30 s"
        first.wait(timeout=240)
    finally:
        stop_daemon(first, timeout_s=10)
    out1 = log1.read_text()
    assert first.returncode != 0, out1[-3000:]  # a job failed: the default target is not built
    assert (finished_out / "metrics.json").is_file(), out1[-3000:]
    assert not (victim_out / "metrics.json").exists(), "the cut job left no result"
    assert not (res / "summary" / "reference.md").exists()
    assert "died with <Signals.SIGTERM" in out1, out1[-3000:]
    cut_at = torch.load(state, map_location="cpu", weights_only=False)["epoch"]
    assert 1 <= cut_at < EPOCHS
    done_mtime = (finished_out / "metrics.json").stat().st_mtime_ns
    dpsgd = json.loads((finished_out / "metrics.json").read_text())

    # --- between allocations: the table so far, from the finished cell only
    so_far = snakemake_runner.run(
        _snakemake(wd, "table_so_far"), cwd=wd, env=_env(wd), capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert so_far.returncode == 0, so_far.stderr[-3000:]
    table = (res / "summary" / "so-far" / "table.md").read_text()
    assert table in so_far.stdout  # printed as well as written
    row = next(line for line in table.splitlines() if line.startswith("| 3 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    ours = f"{100 * dpsgd['test_accuracy']:.2f} ± 0.00 (1 seed)"
    assert cells[1:5] == ["84.55 ± 0.17", ours, "85.91 ± 0.22",
                          f"cut, resumes after epoch {cut_at}/{EPOCHS}"], row  # fmt: skip
    assert cells[5:] == ["8.80%", "–"], row  # no ERR of ours without both cells
    assert "1 of 2 fine-tuning runs finished, 1 cut" in table
    runs = list(csv.DictReader(open(res / "summary" / "so-far" / "runs.csv")))
    assert [(r["algorithm"], r["status"], r["epoch"]) for r in runs] == [
        ("dpsgd", "finished", ""),
        ("dpsat", "cut", str(cut_at)),
    ]
    assert state.exists() and (res / "pretrain" / "scratch" / "model.pt").is_file()

    # --- next allocation: the same command; an uninterrupted run of the cut job beside it
    ref_wd = tmp_path / "uninterrupted"
    ref_wd.mkdir()
    reference = subprocess.Popen(
        [sys.executable, "-m", "dpadapter", "--config", str(wd / "config.yaml"), "finetune",
         "--upstream", "scratch", "--task", "syn-shift", "--algo", "dpsat", "--eps", "3",
         "--seed", "0", "--ckpt", str(res / "pretrain" / "scratch" / "model.pt"),
         "--out", str(ref_wd / "ft")],
        cwd=ref_wd, env=_env(ref_wd, **SNAKEMAKE_THREADS_ENV), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip
    second = snakemake_runner.run(
        _snakemake(wd), cwd=wd, env=_env(wd), capture_output=True, text=True, timeout=300
    )
    ref_log, _ = reference.communicate(timeout=300)
    out2 = second.stdout + second.stderr
    assert second.returncode == 0, out2[-3000:]
    assert reference.returncode == 0, ref_log[-3000:]
    counts = _job_counts(out2)
    assert counts.get("finetune") == 1 and "pretrain" not in counts, counts  # only the cut job
    ran = re.findall(
        r"rule finetune:\n(?:\s+\w+: .*\n)*?\s+output: results/finetune/(\S+)/metrics", out2
    )
    assert ran == [VICTIM], ran
    assert (finished_out / "metrics.json").stat().st_mtime_ns == done_mtime  # not rerun

    resumed = json.loads((victim_out / "metrics.json").read_text())
    whole = json.loads((ref_wd / "ft" / "metrics.json").read_text())
    assert resumed["resumed_from_epoch"] == cut_at and "resumed_from_epoch" not in whole
    # the ledger continued: every planned release once, as in the uninterrupted run
    planned = EPOCHS * STEPS_PER_EPOCH
    assert resumed["privacy"]["steps"] == whole["privacy"]["steps"] == planned
    assert sum(h["steps"] for h in resumed["privacy"]["history"]) == planned
    assert resumed["privacy"]["history"] == whole["privacy"]["history"]
    assert resumed["privacy"]["epsilon"] == pytest.approx(whole["privacy"]["epsilon"], rel=1e-9)
    assert [e["epoch"] for e in resumed["epochs"]] == list(range(1, EPOCHS + 1))
    w_res = torch.load(victim_out / "model.pt", weights_only=False)["state_dict"]
    w_ref = torch.load(ref_wd / "ft" / "model.pt", weights_only=False)["state_dict"]
    assert all(torch.equal(w_res[k], w_ref[k]) for k in w_ref)  # bit for bit
    assert resumed["test_accuracy"] == whole["test_accuracy"]
    assert not state.exists(), "the resume state is removed once the job has finished"

    # the full table: both cells, the finished one's number unchanged
    full = (res / "summary" / "reference.md").read_text()
    row = next(line for line in full.splitlines() if line.startswith("| 3 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1:5] == ["84.55 ± 0.17", ours, "85.91 ± 0.22",
                          f"{100 * resumed['test_accuracy']:.2f} ± 0.00 (1 seed)"], row  # fmt: skip
    assert "not run" not in full and "cut" not in full
