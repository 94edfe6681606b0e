"""How a cell of a summary table is written, and when it is flagged: one home for every table.

A reader compares cells: a method against another, a budget against a smaller one. Both readings
mislead when a cell hides its spread, so every cell reads `mean ± std (n=k)`, a cell from one
seed is marked (`†`: no spread could be measured), and a cell at a larger ε whose accuracy is
*below* that of a smaller ε of the same row is flagged, because more privacy budget should not
cost accuracy:

- `▼` the drop exceeds the combined std sqrt(s_lo² + s_hi²) (the std of the difference of one
  seed's result from each cell, seeds independent), so it is larger than the seed noise;
- `≈` the drop is within that combined std: the cells are indistinguishable at this many seeds;
- `?` one of the two cells has one seed, so the noise is unknown and the drop cannot be judged.

Where both cells know their seeds (`Stat.by_seed`: the fine-tuning table, whose cells of one
seed share the head, the batches and the noise draws), the comparison is paired: the drop is the
mean of the per-seed differences and the noise their std, so a seed that is low in both cells
does not count as noise (issue 48).

Used by the fine-tuning (`stages.aggregate`), HPO (`hpo.network.summary`, `hpo.probe.summary`),
federated (`federated.summary`) and audit (`audit.stage`) tables; `how_to_read` is the note
printed under each of them.
"""

from __future__ import annotations

import csv
import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

SINGLE = "†"
INVERTED = "▼"
WITHIN_NOISE = "≈"
UNKNOWN = "?"
# The most severe flag of a cell is the one shown.
_SEVERITY = {None: 0, WITHIN_NOISE: 1, UNKNOWN: 2, INVERTED: 3}


@dataclass(frozen=True)
class Stat:
    """Mean, sample std (0 for one value) and number of seeds of one cell."""

    mean: float
    std: float
    n: int
    by_seed: tuple[tuple[int, float], ...] = field(default=(), compare=False)

    @classmethod
    def of(cls, values: Sequence[float], seeds: Sequence[int] | None = None) -> Stat:
        """`seeds` (one per value) make the cell pairable with another of the same seeds."""
        xs = [float(v) for v in values]
        if not xs:
            raise ValueError("a cell needs at least one value")
        by_seed = tuple(zip((int(s) for s in seeds), xs, strict=True)) if seeds else ()
        std = statistics.stdev(xs) if len(xs) > 1 else 0.0
        return cls(statistics.fmean(xs), std, len(xs), by_seed)


def combined_std(a: Stat, b: Stat) -> float:
    return math.sqrt(a.std**2 + b.std**2)


def order_flag(lower_eps: Stat, higher_eps: Stat) -> str | None:
    """The flag of the higher-ε cell against one lower-ε cell of its row (None: no drop);
    paired by seed where both cells know their seeds."""
    lo, hi = dict(lower_eps.by_seed), dict(higher_eps.by_seed)
    common = sorted(lo.keys() & hi.keys())
    if len(common) >= 2:
        diffs = [lo[s] - hi[s] for s in common]
        drop = statistics.fmean(diffs)
        if not drop > 0:
            return None
        return INVERTED if drop > statistics.stdev(diffs) else WITHIN_NOISE
    drop = lower_eps.mean - higher_eps.mean
    if not drop > 0:
        return None
    if lower_eps.n < 2 or higher_eps.n < 2:
        return UNKNOWN
    return INVERTED if drop > combined_std(lower_eps, higher_eps) else WITHIN_NOISE


def epsilon_flags(row: Mapping[float, Stat]) -> dict[float, str | None]:
    """Each cell of a row (keyed by ε) against every smaller ε; the most severe flag wins."""
    out: dict[float, str | None] = {}
    for eps, s in row.items():
        flags = [order_flag(row[lo], s) for lo in row if lo < eps]
        out[eps] = max(flags, key=_SEVERITY.__getitem__, default=None)
    return out


def cell(stat: Stat | None, flag: str | None = None, scale: float = 100.0, digits: int = 1) -> str:
    """`mean ± std (n=k)` in the table's unit; `†` for one seed; the ε-order flag after it."""
    if stat is None:
        return "–"
    m = f"{scale * stat.mean:.{digits}f}"
    if stat.n > 1:
        text = f"{m} ± {scale * stat.std:.{digits}f} (n={stat.n})"
    else:
        text = f"{m} (n=1){SINGLE}"
    return f"{text} {flag}" if flag else text


def flagged_cells(
    rows: Iterable[tuple[object, float, Stat]], scale: float = 100.0, digits: int = 1
) -> dict[tuple[object, float], str]:
    """Text of every (row key, ε) cell, each flagged against the smaller ε of its row."""
    by_row: dict[object, dict[float, Stat]] = {}
    for key, eps, stat in rows:
        by_row.setdefault(key, {})[float(eps)] = stat
    out = {}
    for key, row in by_row.items():
        for eps, flag in epsilon_flags(row).items():
            out[(key, eps)] = cell(row[eps], flag, scale, digits)
    return out


def how_to_read(
    quantity: str = "test accuracy (%)",
    unit: str = "seeds",
    upper_bounds: bool = True,
    paired: bool = False,
) -> str:
    """The note under a table: what a cell is and what each mark means (`paired`: the ε marks
    compare seed with seed, `order_flag`)."""
    noise = (
        "the std of its per-seed differences from that cell (paired by seed: the same head, "
        "batches and noise draws)"
        if paired
        else "the combined std sqrt(std₁² + std₂²) of the two cells"
    )
    text = (
        f"**How to read this.** A cell is the mean ± sample std of the {quantity} over {unit}, "
        f"with n the number of {unit}. {SINGLE}: n = 1, no spread was measured — do not compare "
        f"it with other cells as if it had one. A larger ε should not do worse than a smaller "
        f"one of the same row: {INVERTED} it does, on average by more than {noise} (beyond the "
        f"seed noise); {WITHIN_NOISE} it does, but within that (the two cells are "
        f"indistinguishable at this n); {UNKNOWN} it does, but one of the cells has n = 1, so "
        f"the noise is unknown."
    )
    if upper_bounds:
        text += " Every ε is an upper bound from the accountant over every step taken."
    return text


# A cell that has no value by design (not a job that has not run, which is "–").
NOT_MEASURED = "n/a"


def public_absence(pretrain_metrics: Mapping[str, object]) -> str | None:
    """Why a pre-training job reports no public accuracy (its `public_report`); None if it does.

    External weights come with a head trained on other classes, so there is nothing to
    measure; a table that shows a bare dash leaves the reader guessing whether a job failed.
    """
    if "public_test_accuracy" in pretrain_metrics:
        return None
    why = str(pretrain_metrics.get("public_report") or "the pre-training job reported none")
    return why.removeprefix("skipped: ")


def absence_note(absent: Mapping[str, str], what: str = "public accuracy") -> str:
    """The line under a table that says which rows have no `what`, and why (grouped by reason)."""
    if not absent:
        return ""
    by_reason: dict[str, list[str]] = {}
    for name, why in absent.items():
        by_reason.setdefault(why, []).append(name)
    parts = [f"{', '.join(names)}: {why}" for why, names in by_reason.items()]
    return f"{NOT_MEASURED}: no {what} is measured for " + "; ".join(parts) + "."


def _cell(key: str, value):
    if key == "epsilon":
        return f"{value:g}"  # a grid coordinate, as in the paths (eps1, eps0.5)
    return f"{value:.4f}" if isinstance(value, float) else value


def write_csv(rows: list[dict], path: Path, columns: list[str]) -> None:
    """The summary CSVs (finetune, hpo, federated): `columns` in order, floats to 4 places."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=columns)
        w.writeheader()
        for r in rows:
            w.writerow({k: _cell(k, r[k]) for k in columns if k in r})
