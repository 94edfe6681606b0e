"""The front page's figures, each written from a committed record of the run that measured it.

    python tools/readme_blocks.py            # rewrite every block between its markers
    python tools/readme_blocks.py --check    # exit 1 naming each block that differs and each
                                             # record older than the code it measures
    python tools/readme_blocks.py record make-run --output printed.md --wall-s 612 \\
        --machine "vm, 2 cores" --command "make run CORES=2" [--commit SHA] [--date ...]

A figure typed into the README goes stale without anyone noticing (the DPAdapter sentence said
one thing while `make run` printed another). Here a figure lives in a record,
`docs/records/<kind>/<date>-<commit>/record.json` (date, time, commit, machine, command, the
figures, and the git trees of the paths the figures depend on) with the output the run printed
beside it; a block, `<!-- NAME:begin -->` ... `<!-- NAME:end -->` in a page, is rendered from
the newest record of each kind it reads. `--check` (and tests/tools/test_readme_blocks.py)
fails when a block is not what its records render, and when a record's trees are not HEAD's:
the code that produced it changed since it ran. Trees, not commits, so that the check holds
on a fresh clone, a shallow one, and after a rebase; it reads them with dulwich (in the venv
with DVC) or git, and says that it cannot tell when neither can read the repository.

To add a kind (e.g. the Table 1 answer of `configs/table1.yaml`): a `Kind` in `KINDS` with the
paths its figures depend on, a render function, a `Block` in `BLOCKS` naming both, the markers
in the page, then `record KIND ...` after a run, and `python tools/readme_blocks.py`.
GPU cells are records too (`docs/gpu-runs/cells/`, written by `bench/gpu/gpu_runs.py
collect`); they carry a commit, not trees, and their block says which commits ran them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECORDS = REPO / "docs" / "records"
README = REPO / "README.md"
sys.path.insert(0, str(REPO / "bench" / "gpu"))
import gpu_runs  # noqa: E402  (the Table 2 cells and the marker replacement)


class CannotTell(Exception):
    """The repository's trees cannot be read here (no git, no dulwich, not a checkout)."""


@dataclasses.dataclass(frozen=True)
class Kind:
    """What is measured, and the paths whose content its figures depend on (`()`: none can
    be named, so freshness is not checked)."""

    name: str
    measures: tuple[str, ...]
    about: str


@dataclasses.dataclass(frozen=True)
class Record:
    kind: str
    date: str
    time: str
    commit: str
    machine: str
    command: str
    figures: dict
    trees: dict
    folder: Path | None = None
    output: str | None = None  # the file beside record.json with what the run printed

    def __post_init__(self) -> None:
        if not re.fullmatch(r"\d{4}-\d\d-\d\d", self.date):
            raise ValueError(f"{self.folder}: date {self.date!r} is not YYYY-MM-DD")
        if not re.fullmatch(r"[0-9a-f]{7,40}", self.commit):
            raise ValueError(f"{self.folder}: commit {self.commit!r} is not a git hash")
        if not self.machine or not self.command:
            raise ValueError(f"{self.folder}: a record names its machine and command")

    @property
    def short(self) -> str:
        return self.commit[:7]

    def printed(self) -> str:
        if self.folder is None or self.output is None:
            raise ValueError(f"record {self.kind} of {self.date} kept no printed output")
        return (self.folder / self.output).read_text()


# what the default pipeline's figures depend on
PIPELINE = ("src", "workflow", "Snakefile", "config.yaml", "requirements.txt")

KINDS = {
    k.name: k
    for k in (
        Kind(
            "make-run",
            PIPELINE,
            "`make run` of the default config: what it printed, and its wall time",
        ),
        Kind(
            "make-run-time",
            PIPELINE,
            "`make run` on a fresh clone on a quiet machine: its wall time, set-up included",
        ),
        Kind(
            "table1",
            (*PIPELINE, "configs/table1.yaml"),
            "`make run CONFIG=configs/table1.yaml` after `make run`: the Table 1 answer",
        ),
        Kind("gpu-cell", (), "a DP-SAT Table 2 cell on a GPU (docs/gpu-runs/cells/)"),
    )
}


def load(folder: Path) -> Record:
    data = json.loads((folder / "record.json").read_text())
    fields = {f.name for f in dataclasses.fields(Record)} - {"folder"}
    return Record(**{k: v for k, v in data.items() if k in fields}, folder=folder)


def records(kind: str, root: Path = RECORDS) -> list[Record]:
    """Every record of a kind, newest first."""
    if kind == "gpu-cell":
        return _gpu_cells()
    found = [load(p.parent) for p in (root / kind).glob("*/record.json")]
    for r in found:
        if r.kind != kind:
            raise ValueError(f"{r.folder}: a {r.kind} record in the {kind} folder")
    return sorted(found, key=lambda r: (r.date, r.time, r.commit), reverse=True)


def _gpu_cells() -> list[Record]:
    out = []
    for m, run in gpu_runs._cells(gpu_runs.DONE):
        w = m["wildcards"]
        figures = {"algorithm": w["algo"], "epsilon": float(w["eps"]), "seed": int(w["seed"]),
                   "test_accuracy": m["test_accuracy"]}  # fmt: skip
        command = f"bash bench/gpu/gpu_session.sh {run['command']}"
        out.append(
            Record(kind="gpu-cell", date=run["date"], time="", commit=run["commit"],
                   machine=run["card"], command=command, figures=figures, trees={})
        )  # fmt: skip
    return out


# --- the repository's trees ------------------------------------------------------------------


def trees(paths: tuple[str, ...], commit: str = "HEAD", repo: Path = REPO) -> dict[str, str]:
    """The git object of each path at `commit` ("" where absent). Raises CannotTell."""
    try:
        from dulwich.object_store import tree_lookup_path
        from dulwich.repo import Repo
    except ImportError:
        return _trees_by_git(paths, commit, repo)
    try:
        with Repo(str(repo)) as r:
            sha = r.head() if commit == "HEAD" else _resolve(r, commit)
            tree = r[sha].tree
            out = {}
            for p in paths:
                try:
                    out[p] = tree_lookup_path(r.__getitem__, tree, p.encode())[1].decode()
                except KeyError:
                    out[p] = ""
            return out
    except CannotTell:
        raise
    except Exception as e:  # not a repository, a worktree dulwich cannot read, ...
        raise CannotTell(f"dulwich cannot read {repo}: {e}") from e


def _resolve(r, commit: str) -> bytes:
    if len(commit) == 40:
        return commit.encode()
    hits = {bytes(s) for s in r.object_store if bytes(s).startswith(commit.encode())}
    if len(hits) != 1:
        raise CannotTell(f"commit {commit} is {'ambiguous' if hits else 'not here'}")
    return hits.pop()


def _trees_by_git(paths: tuple[str, ...], commit: str, repo: Path) -> dict[str, str]:
    out = {}
    for p in paths:
        try:
            res = subprocess.run(["git", "-C", str(repo), "rev-parse", f"{commit}:{p}"],
                                 capture_output=True, text=True, timeout=30)  # fmt: skip
        except (OSError, subprocess.SubprocessError) as e:
            raise CannotTell(f"neither dulwich nor git can read {repo}: {e}") from e
        if res.returncode and "does not exist" not in res.stderr + res.stdout:
            raise CannotTell(f"git cannot read {repo}: {res.stderr.strip()}")
        out[p] = res.stdout.strip() if res.returncode == 0 else ""
    return out


def stale(record: Record, head: dict[str, str] | None = None) -> str | None:
    """Why the record is older than the code it measures (None: it is current, or its kind
    names no paths). Raises CannotTell when the trees cannot be read."""
    measures = KINDS[record.kind].measures
    if not measures:
        return None
    head = trees(measures) if head is None else head
    changed = [p for p in measures if record.trees.get(p) != head.get(p)]
    if not changed:
        return None
    return (
        f"{_shown(record.folder)}: ran on {record.short}, and "
        f"{', '.join(changed)} changed since; run `{record.command}` again and add its record"
    )


def _shown(path: Path | None) -> str:
    return str(path.relative_to(REPO)) if path and path.is_relative_to(REPO) else str(path)


# --- the blocks ------------------------------------------------------------------------------


def _row_cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _table_after(text: str, lead: str) -> list[dict[str, str]]:
    """The rows, as {column: cell}, of the first markdown table after the line that starts
    with `lead`."""
    lines = text.splitlines()
    start = next(i for i, s in enumerate(lines) if s.startswith(lead))
    first = next(i for i in range(start, len(lines)) if lines[i].startswith("|"))
    rows = []
    for s in lines[first:]:
        if not s.startswith("|"):
            break
        if not set(s) <= set("|-: "):
            rows.append(_row_cells(s))
    head, *rows = rows
    return [dict(zip(head, row, strict=True)) for row in rows]


def _paired_row(text: str, a: str, b: str, algorithm: str) -> dict[str, str]:
    for cells in _table_after(text, "### Paired differences"):
        if cells["comparison"] == f"{a} − {b}" and cells["algorithm"] == algorithm:
            return cells
    raise ValueError(f"the printed paired section has no {a} − {b} ({algorithm}) row")


def paired(text: str, a: str, b: str, algorithm: str = "dpsgd") -> dict[str, str]:
    """The pooled estimate, its interval and the detectable difference of `a` − `b`, as the
    paired section printed them."""
    cells = _paired_row(text, a, b, algorithm)
    hit = re.fullmatch(r"\*\*(\S+)\*\* \[(\S+), (\S+)\]", cells["pooled"])
    if not hit:
        raise ValueError(f"{a} − {b}: no pooled estimate printed ({cells['pooled']})")
    est, lo, hi = hit.groups()
    return {"estimate": est, "low": lo, "high": hi, "detectable": cells["detectable"]}


def paired_cell(text: str, a: str, b: str, cell: str, algorithm: str = "dpsgd") -> str:
    """One cell's estimate of `a` − `b` (e.g. cell "fmnist-same ε=1"), as printed."""
    return _paired_row(text, a, b, algorithm)[cell].split(" ")[0]


def budget_gain(text: str, low: str = "1", high: str = "4") -> tuple[float, float]:
    """The range over the table's rows of Average ε=high − Average ε=low, in points."""
    gains = []
    for cells in _table_after(text, "Test accuracy (%) of DP fine-tuning"):
        lo, hi = cells.get(f"Average ε={low}", "–"), cells.get(f"Average ε={high}", "–")
        if lo != "–" and hi != "–":
            gains.append(float(hi) - float(lo))
    if not gains:
        raise ValueError(f"the printed table has no row with both Average ε={low} and ε={high}")
    return min(gains), max(gains)


def _dated(r: Record) -> str:
    return f"`{r.command}` on {r.short}, {r.date}, {r.machine}"


def render_make_run(latest: dict[str, Record]) -> str:
    r = latest["make-run"]
    text = r.printed()
    std = paired(text, "dpadapter", "standard")
    ctl = paired(text, "dpadapter", "control")
    same = paired_cell(text, "standard", "scratch", "fmnist-same ε=1")
    shift = paired_cell(text, "standard", "scratch", "fmnist-shift ε=1")
    lo, hi = budget_gain(text)
    return (
        f"What the table says today: pre-training on public data (standard − scratch, paired by "
        f"seed) is worth {same} points on `fmnist-same` at ε = 1 and {shift} on `fmnist-shift`; "
        f"ε = 4 instead of 1 buys {lo:+.1f} to {hi:+.1f} points on the average over tasks, by "
        f"row. **DPAdapter − standard is {std['estimate']} points [{std['low']}, "
        f"{std['high']}], detectable from {std['detectable']}**; DPAdapter − the "
        f"compute-matched control {ctl['estimate']} [{ctl['low']}, {ctl['high']}], detectable "
        f"from {ctl['detectable']} (pooled over cells and seeds, 95 %; 80 % power); three "
        f"seeds are one draw of the noise, and another draw moves this by about a point ("
        f"[docs/validity.md](docs/validity.md#a-new-noise-realisation-issue-47-the-3-seed-"
        f"headline-does-not-survive-it)). "
        f"Record: {_dated(r)} ([docs/records/](docs/records/), [docs/measured.md]"
        f"(docs/measured.md)).\n"
    )


def render_commands(latest: dict[str, Record]) -> str:
    r = latest["make-run-time"]
    wall = r.figures["wall_s"]
    return (
        f"On 2 CPU cores `make run` takes about {wall / 60:.0f} minutes ({wall:.0f} s on a fresh "
        f"clone, set-up included: {r.short}, {r.date}, {r.machine}).\n"
    )


TABLE1_LEAD = "### Does DPAdapter help each algorithm here?"


def render_table1(latest: dict[str, Record]) -> str:
    r = latest["table1"]
    text = r.printed()
    rows = [c for c in _table_after(text, TABLE1_LEAD)
            if c["comparison"] == "dpadapter − standard"]  # fmt: skip
    if not rows:
        raise ValueError(f"{r.folder}: the printed Table 1 answer has no DPAdapter − standard row")
    # the answer line per algorithm, under the table: "- DP-SGD: **not detectably**: ..."
    after = text[text.index(TABLE1_LEAD) :]
    verdict = dict(re.findall(r"^- (.+?): \*\*(.+?)\*\*", after, flags=re.M))

    def one(c: dict[str, str]) -> str:
        name = c["algorithm"]
        if name not in verdict:
            raise ValueError(f"{r.folder}: no answer line for {name} under the Table 1 answer")
        ours = c["ours [95 % CI]"].replace("-", "−")
        paper = c["paper mean"]
        return (f"{name}: {verdict[name]} ({ours}, detectable {c['detectable']}"
                + ("" if paper == "–" else f"; paper {paper}") + ")")  # fmt: skip

    return (
        f"The paper's Table 1 question at our scale, does DPAdapter help each DP algorithm? "
        f"(`make run CONFIG=configs/table1.yaml` after `make run`: five upstreams, two for DP-SAT "
        f"and DP-SAM, × three tasks × ε ∈ {{1, 4}} × three seeds, each algorithm with its own "
        f"recipe from the public proxy). DPAdapter − standard, pooled, points [95 %]: "
        f"{'; '.join(one(c) for c in rows)}. Record: {_dated(r)} "
        f"([docs/validity.md](docs/validity.md#table-1-at-our-scale-every-algorithm-every-"
        f"upstream-issue-67-2026-11-29)).\n"
    )


def render_gpu(latest: dict[str, Record], cells: list[Record] | None = None) -> str:
    from dpadapter.validation.compose import load as load_config

    cells = records("gpu-cell") if cells is None else cells
    if not cells:
        return "DP-SAT Table 2 on a GPU: no cell finished yet.\n"
    paper = {(c.algorithm, float(c.epsilon)): c.mean
             for c in load_config(gpu_runs.CONFIG).reference.cells}  # fmt: skip
    off = [100 * c.figures["test_accuracy"] - paper[(c.figures["algorithm"],
           c.figures["epsilon"])] for c in cells]  # fmt: skip
    cards = ", ".join(sorted({c.machine for c in cells}))
    commits = ", ".join(sorted({c.short for c in cells}))
    dates = ", ".join(sorted({c.date for c in cells}))
    seeds = ", ".join(str(s) for s in sorted({c.figures["seed"] for c in cells}))
    return (
        f"DP-SAT Table 2 on GPUs so far: {len(cells)} of {len(gpu_runs.PLAN)} cells "
        f"({cards}; {dates}; commits {commits}); ours − the paper's mean {min(off):+.2f} to "
        f"{max(off):+.2f} points (seed {seeds}; the paper averages 5).\n"
    )


@dataclasses.dataclass(frozen=True)
class Block:
    name: str  # the markers: <!-- name:begin --> ... <!-- name:end -->
    kinds: tuple[str, ...]  # the newest record of each is handed to `render`
    render: Callable[[dict[str, Record]], str]
    page: Path = README


BLOCKS = (
    Block("make-run", ("make-run",), render_make_run),
    Block("commands", ("make-run-time",), render_commands),
    Block("table1", ("table1",), render_table1),
    Block("gpu", ("gpu-cell",), render_gpu),
)


def latest(kinds: tuple[str, ...], root: Path = RECORDS) -> dict[str, Record]:
    out = {}
    for k in kinds:
        found = records(k, root)
        if not found:
            raise ValueError(f"no {k} record under {root}/{k}/")
        out[k] = found[0]
    return out


def problems(blocks=BLOCKS, root: Path = RECORDS) -> list[str]:
    """Each block that differs from what the newest records of its kinds render."""
    found = []
    for b in blocks:
        body = b.render(latest(b.kinds, root))
        text = b.page.read_text()
        try:
            if gpu_runs.replace_between(text, body, b.name) != text:
                found.append(f"{_shown(b.page)}: block {b.name} is not its records'")
        except SystemExit as e:  # no markers
            found.append(f"{_shown(b.page)}: {e}")
    return found


def stale_records(blocks=BLOCKS, root: Path = RECORDS, head: dict | None = None) -> list[str]:
    """Each record a block reads (the newest of its kind) that is older than the code it
    measures; `head`: the trees to compare with (default HEAD's). Raises CannotTell."""
    kinds = dict.fromkeys(k for b in blocks for k in b.kinds)
    out = []
    for k in kinds:
        if KINDS[k].measures:
            paths = KINDS[k].measures
            why = stale(latest((k,), root)[k], head if head is not None else trees(paths))
            if why:
                out.append(why)
    return out


def write(blocks=BLOCKS, root: Path = RECORDS) -> None:
    for b in blocks:
        text = b.page.read_text()
        new = gpu_runs.replace_between(text, b.render(latest(b.kinds, root)), b.name)
        if new != text:
            b.page.write_text(new)


def add_record(kind: str, args: argparse.Namespace, root: Path = RECORDS) -> Path:
    """Write a record of a run that has finished: its figures and what it printed."""
    git = ["git", "-C", str(REPO), "rev-parse", args.commit]
    commit = args.commit
    if len(commit) != 40:
        commit = subprocess.run(git, capture_output=True, text=True, check=True).stdout.strip()
    now = datetime.now(UTC)
    date, time = args.date or now.strftime("%Y-%m-%d"), args.time or now.strftime("%H:%M")
    figures = dict(json.loads(args.figures)) if args.figures else {}
    if args.wall_s is not None:
        figures["wall_s"] = args.wall_s
    folder = root / kind / f"{date}-{commit[:7]}"
    if folder.exists():
        raise SystemExit(f"{folder} exists: a run is recorded once")
    rec = Record(kind, date, time, commit, args.machine, args.command, figures,
                 trees(KINDS[kind].measures, commit), folder,
                 "printed.md" if args.output else None)  # fmt: skip
    folder.mkdir(parents=True)
    if args.output:
        shutil.copyfile(args.output, folder / "printed.md")
    data = {f.name: getattr(rec, f.name) for f in dataclasses.fields(rec) if f.name != "folder"}
    (folder / "record.json").write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
    return folder


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if a block or record is stale")
    sub = ap.add_subparsers(dest="cmd")
    r = sub.add_parser("record", help="record a finished run under docs/records/KIND/")
    r.add_argument("kind", choices=[k for k in KINDS if KINDS[k].measures])
    r.add_argument("--machine", required=True)
    r.add_argument("--command", required=True, help="the command as run")
    r.add_argument("--commit", default="HEAD", help="the commit whose tree ran")
    r.add_argument("--output", type=Path, help="what the run printed (kept as printed.md)")
    r.add_argument("--wall-s", type=float)
    r.add_argument("--figures", help="more figures, a JSON object")
    r.add_argument("--date")
    r.add_argument("--time")
    args = ap.parse_args(argv)
    if args.cmd == "record":
        print(add_record(args.kind, args).relative_to(REPO))
        return 0
    if not args.check:
        write()
    found = problems()
    try:
        found += stale_records()
    except CannotTell as e:
        print(f"cannot tell whether the records are current: {e}")
    for p in found:
        print(p)
    if found and args.check:
        print("run: python tools/readme_blocks.py (and record what is stale)")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
