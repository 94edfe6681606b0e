"""The table so far: the fine-tuning runs that have finished, summarised while others are missing.

`aggregate` and `reference` (the default target's tables) need every run of the grid, so on a
cluster of short allocations, where a grid finishes over many `snakemake` calls, they appear
only at the end. This stage reads what is there now and runs nothing: every run of the config's
fine-tuning grid is

- **finished**: its `metrics.json` exists (a job writes it last, atomically, after `model.pt`);
- **cut**: no `metrics.json`, but a resume state (`<results_dir>/.resume/finetune/...`) that
  holds k of the E epochs: the next `snakemake` call resumes it after epoch k (or it is running
  now, in an allocation of its own);
- **not run yet**: neither (a resume state that cannot be read counts here: the job starts over).

It writes `<results_dir>/summary/so-far/`: `runs.csv` (every run and its status), `finetune.csv`
(the finished runs, mean ± std over their seeds, as `aggregate` computes them) and `table.md`
(the config's published table beside ours as `reference.md` shows it, or the Table-1 layout of
`finetune.md` without a `reference` section, then the runs that are not finished). A cell
without a finished run is marked, never filled in; a cell with some of its seeds says how many.
"""

from __future__ import annotations

import datetime
import sys
from pathlib import Path

from dpadapter.ground.tables import write_csv
from dpadapter.settings import Config
from dpadapter.stages import aggregate, reference
from dpadapter.train.resume import resume_file_path

FINISHED, CUT, NOT_RUN = "finished", "cut", "not run yet"
RUN_COLUMNS = ["upstream", "task", "algorithm", "epsilon", "seed", "status", "epoch", "epochs"]


def run_folder(cfg: Config, up: str, task: str, folder: str, eps: float, seed: int) -> Path:
    """Where the `finetune` rule writes a run's outputs (workflow/rules/finetune.smk); `folder`
    is the algorithm's (`FinetuneConfig.folder`)."""
    return Path(cfg.results_dir, "finetune", up, task, folder, f"eps{eps:g}", f"seed{seed}")


def saved_epoch(state: Path) -> int | None:
    """The epochs a resume state holds (None: no state, or one a job could not read either)."""
    if not state.is_file():
        return None
    import torch

    try:  # mmap: only the small `epoch` entry is read, not the model's tensors
        return int(torch.load(state, map_location="cpu", weights_only=False, mmap=True)["epoch"])
    except Exception as exc:  # the job ignores such a state too, and starts from the beginning
        print(f"warning: unreadable resume state {state} ({type(exc).__name__})", file=sys.stderr)
        return None


def runs(cfg: Config) -> list[dict]:
    """Every run of the fine-tuning grid with its status (and the epochs a cut one holds)."""
    out = []
    for up, task, algo, eps, seed, strategy in cfg.finetune_grid():
        folder = cfg.finetune.folder(algo, strategy)
        metrics = run_folder(cfg, up, task, folder, eps, seed) / "metrics.json"
        row = {"upstream": up, "task": task, "algorithm": algo, "strategy": strategy,
               "epsilon": eps, "seed": seed, "epochs": cfg.finetune.epochs, "epoch": None,
               "metrics": metrics}  # fmt: skip
        if metrics.is_file():
            row["status"] = FINISHED
        else:
            parts = (up, task, folder, f"eps{eps:g}", f"seed{seed}")
            row["epoch"] = saved_epoch(resume_file_path(cfg.results_dir, "finetune", *parts))
            row["status"] = NOT_RUN if row["epoch"] is None else CUT
        out.append(row)
    return out


def describe(r: dict) -> str:
    """A run that has not finished, in words."""
    if r["status"] == CUT:
        return f"cut, resumes after epoch {r['epoch']}/{r['epochs']}"
    return r["status"]


def _cell_key(r: dict) -> tuple:
    return r["upstream"], r["task"], r["algorithm"], float(r["epsilon"])


def _missing(seeds: list[dict]) -> str:
    """What a cell of the published table without a finished seed shows."""
    if len(seeds) == 1:
        return describe(seeds[0])
    cut = sum(r["status"] == CUT for r in seeds)
    return f"0 of {len(seeds)} seeds ({cut} cut)" if cut else NOT_RUN


def reference_rows(rows: list[dict], all_runs: list[dict], cfg: Config) -> list[dict]:
    """`reference.compare`'s rows, each with the seeds planned and, if unfinished, its status."""
    by_cell: dict[tuple, list[dict]] = {}
    for r in all_runs:
        by_cell.setdefault(_cell_key(r), []).append(r)
    table = reference.compare(rows, cfg.reference)
    for t in table:
        seeds = by_cell.get(_cell_key(t), [])
        t["n_planned"] = len(seeds) or None
        t["status"] = _missing(seeds) if seeds else "not in the config's grid"
    return table


def markdown(all_runs: list[dict], rows: list[dict], cfg: Config, now: str) -> str:
    done = sum(r["status"] == FINISHED for r in all_runs)
    cut = sum(r["status"] == CUT for r in all_runs)
    head = (
        f"Table so far ({now}): {done} of {len(all_runs)} fine-tuning runs finished, {cut} cut "
        f"(each resumes after its last saved epoch on the next `snakemake` call), "
        f"{len(all_runs) - done - cut} not run yet. Ours: the finished seeds only. A run that "
        "is running now shows as cut (after its last saved epoch) or not run yet (before it)."
    )
    if cfg.reference is not None:
        table = reference_rows(rows, all_runs, cfg)
        title = f"{cfg.reference.name}: so far"
        text = reference.markdown(table, cfg.reference, title=title).rstrip("\n")
        first, rest = text.split("\n", 1)
        text = f"{first}\n\n{head}\n{rest}"
    else:
        body = (
            aggregate.table1_markdown(
                rows, list(cfg.upstreams), algorithm_order=list(cfg.grid_algorithms())
            )
            if rows
            else "No run finished."
        )
        text = f"# Fine-tuning: so far\n\n{head}\n\n{body}".rstrip("\n")
    unfinished = [r for r in all_runs if r["status"] != FINISHED]
    lines = [text, "", "## Runs not finished", ""]
    lines += [
        f"- `{r['upstream']}` → `{r['task']}`, {r['algorithm']}, ε = {r['epsilon']:g}, "
        f"seed {r['seed']}: {describe(r)}"
        for r in unfinished
    ] or ["None: every run of the grid has finished (the default target writes the full tables)."]
    return "\n".join(lines) + "\n"


def run(cfg: Config, out_dir: Path | None = None) -> tuple[list[dict], Path]:
    """Write the table so far into `out_dir` (default `<results_dir>/summary/so-far`)."""
    out_dir = Path(out_dir or Path(cfg.results_dir, "summary", "so-far"))
    all_runs = runs(cfg)
    rows = aggregate.collect([r["metrics"] for r in all_runs if r["status"] == FINISHED])
    write_csv(all_runs, out_dir / "runs.csv", RUN_COLUMNS)
    write_csv(rows, out_dir / "finetune.csv", aggregate.COLUMNS)
    now = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    md = out_dir / "table.md"
    md.write_text(markdown(all_runs, rows, cfg, now))
    return all_runs, md
