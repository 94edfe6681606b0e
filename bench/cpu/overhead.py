"""Where a finished run's time goes: each job's wall time against the training inside it.

Snakemake's `benchmark:` file of a job (`RESULTS/benchmarks/...tsv`, column `s`) is the wall time
of its whole shell command: interpreter start, imports, config validation, data and checkpoint
loading, training, writing the outputs, exit. A training job's `metrics.json` records
`wall_time_s`, the span of `dpadapter.train.job.training_job`: from after device set-up to the end
of
the stage's training and evaluation, MLflow's `start_run` included, writing metrics.json and the
MLflow artifact excluded. The difference is the fixed cost per job that a faster training step
cannot remove, which is what this report is for.

    .venv/bin/python bench/cpu/overhead.py RESULTS_DIR [--dry-run-config CONFIG] [--json OUT]

With `--dry-run-config` it also times `snakemake -n --configfile CONFIG` (one process): the
scheduler's cost of building the DAG before the first job starts. See `time_dry_run` for how it
keeps that run from writing into the project or its results. Needs only the standard library.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Each rule with a `benchmark:` directive (workflow/rules/*.smk), in workflow order: the path of
# its benchmark file relative to RESULTS/benchmarks, and where its job's metrics.json lies
# relative to RESULTS (None: the job writes none). `j` is the part the two share.
# tests/bench/test_overhead.py checks this table against the rule files.
_SEG = r"[^/]+"
_HPO = rf"{_SEG}/{_SEG}/{_SEG}/seed[0-9]+"
RULES: tuple[tuple[str, str, str | None], ...] = (
    ("warmup", r"(?P<j>warmup)\.tsv", "{j}/metrics.json"),
    ("pretrain", rf"pretrain/(?P<j>{_SEG})\.tsv", "pretrain/{j}/metrics.json"),
    (
        "finetune",
        rf"finetune/(?P<j>{_SEG}/{_SEG}/{_SEG}/eps{_SEG}/seed[0-9]+)\.tsv",
        "finetune/{j}/metrics.json",
    ),
    ("hpo_trial", rf"hpo/(?P<j>{_HPO}/trials/s[0-9]+/t[0-9]+)\.tsv", "hpo/{j}/metrics.json"),
    ("hpo_final", rf"hpo/(?P<j>{_HPO})/final\.tsv", "hpo/{j}/linear_scaling/metrics.json"),
    (
        "random_search",
        rf"hpo/(?P<j>{_HPO})/random_search\.tsv",
        "hpo/{j}/random_search/metrics.json",
    ),
    ("grid_run", rf"hpo/(?P<j>{_SEG}/{_SEG}/{_SEG}/grid/p[0-9]+)\.tsv", "hpo/{j}/metrics.json"),
    (
        "federated_run",
        rf"federated/(?P<j>{_SEG}/{_SEG}/{_SEG}/eps{_SEG}/T[0-9]+/seed[0-9]+)\.tsv",
        "federated/{j}/metrics.json",
    ),
    # audit.json has a wall_time_s too, but over another span (data loading included): not used.
    ("audit_run", rf"audit/(?P<j>{_SEG}/eps{_SEG})\.tsv", None),
)


class OverheadError(Exception):
    """A results tree that cannot be read as described (the message names the file)."""


@dataclass
class Job:
    benchmark: str  # relative to RESULTS/benchmarks
    wall_s: float
    training_s: float | None  # metrics.json wall_time_s; None when there is none
    # metrics.json timing_s: seconds by phase (dpadapter.train.phase_clock); empty without
    phases: dict[str, float] = field(default_factory=dict)


@dataclass
class RuleSummary:
    rule: str
    jobs: int
    wall_mean_s: float | None
    wall_max_s: float | None
    wall_sum_s: float
    training_jobs: int  # jobs with a training time; the overheads are over these
    training_mean_s: float | None
    overhead_mean: float | None  # mean over jobs of (wall - training) / wall
    overhead_of_sums: float | None  # (sum wall - sum training) / sum wall, same jobs
    job_list: list[Job] = field(default_factory=list)


def match_rule(rel: str) -> tuple[str, str | None] | None:
    """(rule, metrics.json path relative to RESULTS or None) of a benchmark file, else None."""
    for rule, pattern, metrics in RULES:
        m = re.fullmatch(pattern, rel)
        if m:
            return rule, metrics.format(j=m["j"]) if metrics else None
    return None


def read_benchmark(path: Path) -> float:
    """Wall seconds (`s`) of a Snakemake benchmark file; its last row when it has several
    (`repeat()`), the run whose metrics.json is on disk."""
    try:
        lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
    except (OSError, UnicodeDecodeError) as exc:
        raise OverheadError(f"{path}: cannot read benchmark file: {exc}") from None
    if not lines:
        raise OverheadError(f"{path}: empty benchmark file")
    header = lines[0].split("\t")
    if "s" not in header:
        raise OverheadError(f"{path}: no 's' column in the header {lines[0]!r}")
    if len(lines) < 2:
        raise OverheadError(f"{path}: header but no data row")
    row = lines[-1].split("\t")
    if len(row) != len(header):
        raise OverheadError(f"{path}: row has {len(row)} fields, header {len(header)}")
    try:
        s = float(row[header.index("s")])
    except ValueError:
        raise OverheadError(f"{path}: 's' is not a number: {row[header.index('s')]!r}") from None
    if not math.isfinite(s) or s < 0:
        raise OverheadError(f"{path}: 's' is not a wall time: {s}")
    return s


def read_training(path: Path) -> float | None:
    """metrics.json's wall_time_s; None when the file or the key is missing."""
    if not path.is_file():
        return None
    try:
        value = json.loads(path.read_text()).get("wall_time_s")
    except (OSError, ValueError, AttributeError) as exc:
        raise OverheadError(f"{path}: cannot read metrics: {exc}") from None
    if value is None:
        return None
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise OverheadError(f"{path}: wall_time_s is not a number: {value!r}")
    return float(value)


def read_phases(path: Path) -> dict[str, float]:
    """metrics.json's timing_s (seconds by phase), {} when the file or the key is missing."""
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text()).get("timing_s") or {}
    except (OSError, ValueError, AttributeError) as exc:
        raise OverheadError(f"{path}: cannot read metrics: {exc}") from None
    if not isinstance(value, dict) or not all(
        isinstance(v, int | float) and not isinstance(v, bool) for v in value.values()
    ):
        raise OverheadError(f"{path}: timing_s is not a table of seconds: {value!r}")
    return {str(k): float(v) for k, v in value.items()}


def collect(results: Path) -> tuple[dict[str, list[Job]], list[str]]:
    """Jobs per rule (workflow order, rules with none left out) and the benchmark files that
    match no rule."""
    bench = results / "benchmarks"
    if not bench.is_dir():
        raise OverheadError(f"{bench}: no benchmarks folder (is {results} a results folder?)")
    jobs: dict[str, list[Job]] = {rule: [] for rule, _, _ in RULES}
    unmatched = []
    for path in sorted(bench.rglob("*.tsv")):
        rel = path.relative_to(bench).as_posix()
        found = match_rule(rel)
        if found is None:
            unmatched.append(rel)
            continue
        rule, metrics = found
        training = read_training(results / metrics) if metrics else None
        phases = read_phases(results / metrics) if metrics else {}
        jobs[rule].append(Job(rel, read_benchmark(path), training, phases))
    return {r: js for r, js in jobs.items() if js}, unmatched


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def summarise(rule: str, jobs: list[Job]) -> RuleSummary:
    walls = [j.wall_s for j in jobs]
    timed = [j for j in jobs if j.training_s is not None]
    wall_timed = sum(j.wall_s for j in timed)
    return RuleSummary(
        rule=rule,
        jobs=len(jobs),
        wall_mean_s=_mean(walls),
        wall_max_s=max(walls) if walls else None,
        wall_sum_s=sum(walls),
        training_jobs=len(timed),
        training_mean_s=_mean([j.training_s for j in timed]),
        # A job of 0 s wall has no share to speak of: left out of the mean.
        overhead_mean=_mean([(j.wall_s - j.training_s) / j.wall_s for j in timed if j.wall_s > 0]),
        overhead_of_sums=(
            (wall_timed - sum(j.training_s for j in timed)) / wall_timed if wall_timed > 0 else None
        ),
        job_list=list(jobs),
    )


def total(rows: list[RuleSummary]) -> RuleSummary:
    """Every job of every rule as one row (its mean overhead weights jobs, not rules)."""
    return summarise("all", [j for r in rows for j in r.job_list])


@dataclass
class DryRun:
    config: str
    wall_s: float
    returncode: int
    command: list[str]
    how: str = (
        "run in a temporary folder holding symlinks to the project's top-level entries except "
        ".snakemake and .dvc: Snakemake's own state goes to the temporary folder, and without "
        ".dvc the Snakefile's dvc_sync step (which may re-time outputs) is skipped"
    )


def default_snakemake() -> list[str]:
    """The snakemake beside this interpreter (the venv's, as `make run` uses), else PATH's."""
    exe = Path(sys.executable).with_name("snakemake")
    return [str(exe)] if exe.is_file() else ["snakemake"]


def time_dry_run(
    config: str | Path,
    project: Path = ROOT,
    command: list[str] | None = None,
    timeout: float | None = None,
) -> DryRun:
    """Wall seconds of one `snakemake -n --configfile CONFIG` over the project's results.

    The dry run reads the real results (the symlinks lead to them), so it sees the finished run
    and plans nothing; what it could write lands in the temporary folder, which is removed. It
    does not see the project's .snakemake metadata (Snakemake reads none then) and leaves out
    the DVC re-timing check, a small part of a real start.
    """
    config = Path(config).resolve()
    if not config.is_file():
        raise OverheadError(f"{config}: no such config file")
    project = Path(project).resolve()
    with tempfile.TemporaryDirectory(prefix="overhead-dryrun-") as tmp:
        for entry in project.iterdir():
            if entry.name not in (".snakemake", ".dvc"):
                os.symlink(entry, Path(tmp, entry.name))
        cmd = [*(command or default_snakemake()), "-n", "--configfile", str(config), "-d", tmp]
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise OverheadError(f"dry run of {config} ran over {timeout} s") from None
        wall = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-15:]
        raise OverheadError(
            f"dry run of {config} failed (exit {proc.returncode}):\n" + "\n".join(tail)
        )
    return DryRun(str(config), wall, proc.returncode, cmd)


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f} %"


def phase_table(rows: list[RuleSummary]) -> list[str]:
    """Per rule whose jobs record phases: mean seconds per job of each phase (over the jobs
    that record it) and its share of the mean wall time of those jobs."""
    lines = []
    for r in rows:
        timed = [j for j in r.job_list if j.phases]
        if not timed:
            continue
        wall = _mean([j.wall_s for j in timed]) or 0.0
        names = list(dict.fromkeys(k for j in timed for k in j.phases))
        lines += [
            "",
            f"Phases of the {r.rule} jobs ({len(timed)} jobs, mean wall {wall:.1f} s):",
            "",
            "| phase | mean s per job | share of wall |",
            "|---|---|---|",
        ]
        accounted = 0.0
        for name in names:
            mean = sum(j.phases.get(name, 0.0) for j in timed) / len(timed)
            accounted += mean
            lines.append(f"| {name} | {mean:.2f} | {_pct(mean / wall if wall else None)} |")
        rest = wall - accounted
        lines.append(
            f"| (the rest: start-up, imports, MLflow, exit) | {rest:.2f} "
            f"| {_pct(rest / wall if wall else None)} |"
        )
    return lines


def markdown(rows: list[RuleSummary], unmatched: list[str], dry: DryRun | None) -> str:
    head = (
        "| rule | jobs | wall/job mean s | wall/job max s | training/job mean s "
        "| overhead (mean over jobs) | overhead (of sums) |"
    )
    lines = [head, "|---|---|---|---|---|---|---|"]
    for r in [*rows, total(rows)] if rows else []:
        training = _s(r.training_mean_s)
        if 0 < r.training_jobs < r.jobs:
            training += f" ({r.training_jobs} of {r.jobs} jobs)"
        name = f"**{r.rule}**" if r.rule == "all" else r.rule
        lines.append(
            f"| {name} | {r.jobs} | {_s(r.wall_mean_s)} | {_s(r.wall_max_s)} | {training} "
            f"| {_pct(r.overhead_mean)} | {_pct(r.overhead_of_sums)} |"
        )
    if not rows:
        lines.append("| (no benchmark files) | 0 | - | - | - | - | - |")
    notes = [
        "",
        "wall: Snakemake benchmark `s` (the job's whole command); training: metrics.json "
        "`wall_time_s` (dpadapter.train.job.training_job); overhead = (wall - training) / wall, "
        "over the jobs with a training time.",
    ]
    if unmatched:
        notes.append(
            f"{len(unmatched)} benchmark file(s) match no rule, left out: "
            + ", ".join(unmatched[:5])
            + (" ..." if len(unmatched) > 5 else "")
        )
    if dry is not None:
        notes.append(f"`snakemake -n --configfile {dry.config}`: {dry.wall_s:.1f} s wall")
    return "\n".join(lines + notes + phase_table(rows)) + "\n"


def report(rows: list[RuleSummary], unmatched: list[str], dry: DryRun | None, results: Path):
    def rule_dict(r: RuleSummary) -> dict:
        d = asdict(r)
        d["job_list"] = [asdict(j) for j in r.job_list]
        return d

    return {
        "results_dir": str(results),
        "rules": [rule_dict(r) for r in rows],
        "all": {k: v for k, v in rule_dict(total(rows)).items() if k != "job_list"},
        "unmatched": unmatched,
        "dry_run": asdict(dry) if dry else None,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", type=Path, help="a results folder (the config's results_dir)")
    p.add_argument("--dry-run-config", help="also time `snakemake -n --configfile CONFIG`")
    p.add_argument("--json", type=Path, help="write the figures (and every job's) as JSON here")
    args = p.parse_args(argv)
    try:
        jobs, unmatched = collect(args.results)
        rows = [summarise(rule, js) for rule, js in jobs.items()]
        dry = time_dry_run(args.dry_run_config) if args.dry_run_config else None
    except OverheadError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(markdown(rows, unmatched, dry), end="")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(report(rows, unmatched, dry, args.results), indent=1) + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
