"""DP-SAT Table 2 over many short GPU loans: keep each finished cell, print the table from all.

A loan gives minutes, a cell of Table 2 takes several, so the table is built loan by loan (issue
44). After a call of `bench/gpu/gpu_session.sh`, here, on the files that came back:

    python bench/gpu/gpu_runs.py collect /work/.device/N --loan 2026-11-28-h200 --commit SHA
    python bench/gpu/gpu_runs.py table            # docs/gpu.md, between markers
    python bench/gpu/gpu_runs.py table --check    # exit 1 if they are out of date (a test)

`collect` copies each finished cell (its metrics.json and the end of its log, never its
checkpoint) into docs/gpu-runs/cells/<config>/<algo>/eps<e>/seed<s>/ with `run.json` (card,
date, loan, the commit that ran, s/step); the next call's session reads that folder and skips
those cells (`gpu_session_table2.queue`). A cell is collected once: a second copy of the same
cell, anything from a dry run or another config, and a cell whose recorded epsilon is not the
accountant's over its recorded releases refuse the whole call, before any cell is written.
The table's epsilons are the accountant's, computed again from each cell's releases.

`table` renders the paper beside ours with the pipeline's own `aggregate.rows_of` and
`reference.compare` (mean ± std over the seeds finished), then every cell with its card and
date. Hand-written: no library keeps results across machines that share no storage but git.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_session_table2 import CONFIG, DONE, PLAN, PROGRESS, collected  # noqa: E402

MARK = "gpu-table2"  # <!-- gpu-table2:begin --> ... <!-- gpu-table2:end -->
DOCS = (REPO / "docs" / "gpu.md",)  # the README has a line of it (tools/readme_blocks.py)
CELL = re.compile(
    r"table2/results/finetune/scratch/fmnist/(\w+)/eps([\d.]+)/seed(\d+)/metrics\.json$"
)
DATE = re.compile(r"^\d{4}-\d\d-\d\d\b")  # a progress line's date, as the job logs it
LOG_TAIL = 8000  # characters of a cell's log kept beside its metrics


def _log_of(tar: tarfile.TarFile, algo: str, eps: str, seed: str) -> str:
    """The cell's log (named with its seed since 2026-11-28, without it before)."""
    for name in (f"table2-{algo}-eps{eps}-seed{seed}", f"table2-{algo}-eps{eps}"):
        for member in tar.getmembers():
            if member.name.endswith(f"logs/{name}.log") or member.name.endswith(
                f"logs/{name}-hooks.log"
            ):
                return tar.extractfile(member).read().decode(errors="replace")
    return ""


def _training_rate(log: str) -> tuple[str | None, float | None]:
    """(date of the last progress line, seconds per DP step from its elapsed time): the line
    the session's projection reads too (`PROGRESS`)."""
    lines = [line for line in log.splitlines() if PROGRESS.search(line)]
    if not lines:
        return None, None
    done, _, h, m, s, *_ = map(int, PROGRESS.search(lines[-1]).groups())
    date = DATE.match(lines[-1])
    return date and date.group(0), (3600 * h + 60 * m + s) / max(done, 1)


def _epsilon(m: dict) -> float:
    """The accountant's epsilon over the releases the cell recorded (its `privacy.history`),
    computed now: the table never prints a number only read back from a file."""
    from dpadapter.privacy import epsilon_from_history
    from dpadapter.privacy.accounting import Segment

    p = m["privacy"]
    history = [Segment(**s) for s in p["history"]]
    return epsilon_from_history(history, p["delta"], p["accountant"])


def _refused(m: dict, cfg) -> str | None:
    """Why a metrics.json is not a result of the config's (the paper's) setting (None: it is)."""
    ft, hp = cfg.finetune, m.get("hyperparameters", {})
    want = {"epochs": ft.epochs, "lr": ft.lr, "momentum": ft.momentum,
            "max_grad_norm": ft.max_grad_norm, "n_train": cfg.tasks["fmnist"].n_train}  # fmt: skip
    off = {k: hp.get(k) for k, v in want.items() if hp.get(k) != v}
    if off:
        return f"not the paper's setting ({off})"
    if m.get("device", {}).get("device") != "cuda":
        return "not run on a GPU"
    p, eps = m["privacy"], _epsilon(m)
    if not (eps <= p["target_epsilon"] and abs(eps - p["epsilon"]) <= 1e-9 * max(eps, 1.0)):
        return (
            f"its recorded epsilon {p['epsilon']!r} is not the accountant's {eps!r} over its "
            f"recorded releases, within the target {p['target_epsilon']!r}"
        )
    return None


def collect(out: Path, loan: str, commit: str, done: Path = DONE) -> list[Path]:
    """Copy each finished cell of the call whose files are in `out` into `done`. Every cell is
    checked before any is written; a cell's metrics.json is written last (`collected`)."""
    from dpadapter.validation.compose import load

    session = json.loads((out / "session.json").read_text())
    if session.get("dry_run"):
        raise SystemExit(f"{out}: a dry run's cells are not results")
    card, cfg = (session.get("versions") or {}).get("card"), load(CONFIG)
    cells = []
    with tarfile.open(out / "artifacts.tar.gz") as tar:
        for member in tar.getmembers():
            hit = CELL.search(member.name)
            if not hit:
                continue
            algo, eps, seed = hit.groups()
            m = json.loads(tar.extractfile(member).read())
            if why := _refused(m, cfg):
                raise SystemExit(f"{member.name}: {why}")
            dest = done / algo / f"eps{float(eps):g}" / f"seed{int(seed)}"
            if (dest / "metrics.json").exists():
                raise SystemExit(f"{dest} exists: a cell is collected once")
            cells.append((dest, m, _log_of(tar, algo, eps, seed)))
    for dest, m, log in cells:
        date, rate = _training_rate(log)
        run = {
            "card": card or m["device"].get("device_name"),
            "date": date,
            "loan": loan,
            "commit": commit,
            "command": " ".join(session.get("options") or []),
            "mode": m["hyperparameters"].get("grad_sample_mode_run"),
            "s_per_step": None if rate is None else round(rate, 4),
            "wall_s": m.get("wall_time_s"),
            "peak_gpu_mib": m["device"].get("peak_memory_mib"),
            "torch": m["device"].get("torch"),
        }
        dest.mkdir(parents=True, exist_ok=True)
        (dest / "finetune.log").write_text(log[-LOG_TAIL:])
        (dest / "run.json").write_text(json.dumps(run, indent=2) + "\n")
        (dest / "metrics.json").write_text(json.dumps(m, indent=2) + "\n")
    return [dest for dest, _, _ in cells]


def _cells(done: Path) -> list[tuple[dict, dict]]:
    """(metrics, run) of every collected cell, in the plan's order."""
    order = {c: i for i, c in enumerate(PLAN)}
    cells = sorted(collected(done).items(), key=lambda kv: order.get(kv[0], len(order)))
    return [
        (json.loads(path.read_text()), json.loads((path.parent / "run.json").read_text()))
        for _, path in cells
    ]


def render(done: Path = DONE) -> str:
    """The table between the markers: the paper beside ours, then each cell."""
    from dpadapter.stages import aggregate, reference
    from dpadapter.validation.compose import load

    cfg = load(CONFIG)
    cells = _cells(done)
    title = (
        f"DP-SAT Table 2 on GPUs, from the cells finished in all loans so far ({len(cells)} of "
        f"{len(PLAN)}; docs/gpu-runs/cells/, written by `python bench/gpu/gpu_runs.py table`)"
    )
    if not cells:
        return f"{title}: none yet.\n"
    table = reference.compare(aggregate.rows_of([m for m, _ in cells]), cfg.reference)
    text = reference.markdown([t for t in table if t["n_seeds"]], cfg.reference, title=title)
    _, text = text.split("\n", 1)  # the title as a heading would break the page's outline
    lines = [
        f"**{title}.**",
        text.rstrip("\n"),
        "",
        "Each cell: s/step is its log's training time over its steps, with the other cells of "
        "its call on the same card (`run.json`: loan, command, wall time).",
        "",
        "| algorithm | ε | seed | test acc % | paper | ε spent | steps | s/step | peak GPU MiB "
        "| mode | card | date | commit |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    paper = {(c.algorithm, float(c.epsilon)): c for c in cfg.reference.cells}
    for m, r in cells:
        w = m["wildcards"]
        p = paper.get((w["algo"], float(w["eps"])))
        ours = 100 * m["test_accuracy"]
        beside = "–" if p is None else f"{p.mean:.2f} ± {p.std:.2f} ({ours - p.mean:+.2f})"
        rate = "–" if r.get("s_per_step") is None else f"{r['s_per_step']:.3f}"
        mem = "–" if r.get("peak_gpu_mib") is None else f"{r['peak_gpu_mib']:.0f}"
        lines.append(
            f"| {w['algo']} | {w['eps']} | {w['seed']} | {ours:.2f} | {beside} | "
            f"{_epsilon(m):.3f} | {m['privacy']['steps']} | {rate} | {mem} | "
            f"{r.get('mode')} | {r.get('card')} | {r.get('date')} | {r.get('commit')} |"
        )
    return "\n".join(lines) + "\n"


def replace_between(text: str, body: str, mark: str = MARK) -> str:
    """`text` with `body` between the markers `mark` (tools/readme_blocks.py's too)."""
    begin, end = f"<!-- {mark}:begin -->", f"<!-- {mark}:end -->"
    if begin not in text or end not in text:
        raise SystemExit(f"no {begin} ... {end} markers")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{begin}\n{body}{end}{tail}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("collect", help="keep the finished cells of a call's files")
    c.add_argument("out", type=Path, help="the folder the call's files came back to")
    c.add_argument("--loan", required=True, help="e.g. 2026-11-28-h200")
    c.add_argument("--commit", required=True, help="the commit whose tree the call ran")
    t = sub.add_parser("table", help="write the table into docs/gpu.md")
    t.add_argument("--check", action="store_true", help="exit 1 if a file is out of date")
    args = ap.parse_args(argv)
    if args.cmd == "collect":
        for dest in collect(args.out, args.loan, args.commit):
            print(f"collected {dest.relative_to(REPO)}")
        return 0
    body, stale = render(), []
    for doc in DOCS:
        new = replace_between(doc.read_text(), body)
        if new != doc.read_text():
            stale.append(doc)
            if not args.check:
                doc.write_text(new)
    if args.check and stale:
        print("out of date: " + ", ".join(str(d.relative_to(REPO)) for d in stale))
        print("run: python bench/gpu/gpu_runs.py table")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
