"""Figures of the federated grid, analogues of Pretrain-DPFL's Figs. 1-3.

- `accuracy_vs_epsilon`: test accuracy against epsilon, one line per strategy, one panel per
  mechanism, at the main round count (Fig. 1 with the CNN, Fig. 2 with ResNet20: the model is
  the config's, named in the title). Above each epsilon, the T1 rule's majority prediction.
- `accuracy_vs_rounds`: test accuracy against the number of rounds T at one epsilon per
  mechanism (Fig. 3).
Rows are `federated.summary.collect` rows (or csv.DictReader rows: strings are parsed).
Error bars are the standard deviation over seeds; accuracies are drawn in percent.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display on pipeline hosts
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402

Row = Mapping[str, Any]
STYLE = {
    "scratch": ("tab:gray", "x", "ST (scratch)"),
    "ht": ("tab:blue", "o", "HT"),
    "ft": ("tab:orange", "s", "FT"),
    "ut": ("tab:green", "^", "UT (T1 rule)"),
    "bitfit": ("tab:purple", "D", "BiTFiT"),
}


def _f(v: Any) -> float:
    if v is None or (isinstance(v, str) and v.strip() == ""):
        return math.nan
    return float(v)


def _series(rows: Sequence[Row], x_key: str, keep) -> dict[tuple[str, str, str], list[tuple]]:
    out: dict[tuple, list[tuple]] = defaultdict(list)
    for r in rows:
        if keep(r):
            key = (r["mechanism"], r["upstream"], r["strategy"])
            out[key].append(
                (_f(r[x_key]), 100 * _f(r["mean_accuracy"]), 100 * _f(r["std_accuracy"]))
            )
    return {k: sorted(v) for k, v in out.items()}


def _draw(ax, series: dict, mech: str, multi_upstream: bool) -> None:
    for (m, up, strat), pts in sorted(series.items()):
        if m != mech:
            continue
        color, marker, label = STYLE.get(strat, ("k", ".", strat))
        if multi_upstream and strat != "scratch":
            label = f"{label} [{up}]"
        xs, ys, es = zip(*pts, strict=True)
        ax.errorbar(xs, ys, yerr=es, color=color, marker=marker, capsize=3, label=label)


def _mechs(rows: Sequence[Row]) -> list[str]:
    return sorted({r["mechanism"] for r in rows}, key=lambda m: (m != "gaussian", m))


def _save(fig, out: Path) -> Path:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def accuracy_vs_epsilon(rows: Sequence[Row], out: Path, rounds: int, title: str = "") -> Path:
    """Figs. 1-2: accuracy against epsilon per strategy at `rounds` rounds."""
    rows = [r for r in rows if int(_f(r["rounds"])) == rounds]
    mechs = _mechs(rows) or ["gaussian"]
    multi = len({r["upstream"] for r in rows if r["strategy"] != "scratch"}) > 1
    series = _series(rows, "epsilon", lambda r: True)
    fig, axes = plt.subplots(1, len(mechs), figsize=(5.2 * len(mechs), 4.2), squeeze=False)
    for ax, mech in zip(axes[0], mechs, strict=True):
        _draw(ax, series, mech, multi)
        preds = {}
        for r in rows:
            if r["mechanism"] == mech and r["strategy"] in ("ht", "ft") and r.get("predicted_best"):
                preds[_f(r["epsilon"])] = str(r["predicted_best"]).upper()
        for x, p in sorted(preds.items()):
            ax.annotate(
                f"rule: {p}",
                (x, 1.0),
                xycoords=("data", "axes fraction"),
                ha="center",
                va="bottom",
                fontsize=8,
                color="tab:green",
            )
        ax.set_xscale("log")
        xs = sorted({x for line in ax.lines for x in line.get_xdata()})
        ax.set_xticks(xs, [f"{x:g}" for x in xs])  # the grid's epsilons, not 3x10^0 minor labels
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xlabel("ε" + (" (δ = 0, pure DP)" if mech == "laplace" else ""))
        ax.set_ylabel("test accuracy (%)")
        ax.set_title(f"{mech} mechanism, T = {rounds}", pad=16)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    return _save(fig, out)


def accuracy_vs_rounds(
    rows: Sequence[Row], out: Path, epsilons: Mapping[str, float] | None = None, title: str = ""
) -> Path:
    """Fig. 3: accuracy against the number of rounds T at one epsilon per mechanism.

    Without a configured epsilon for a mechanism, the epsilon with most round counts is used.
    """
    mechs = _mechs(rows) or ["gaussian"]
    chosen: dict[str, float] = {}
    for mech in mechs:
        if epsilons and mech in epsilons:
            chosen[mech] = float(epsilons[mech])
            continue
        by_eps: dict[float, set[int]] = defaultdict(set)
        for r in rows:
            if r["mechanism"] == mech:
                by_eps[_f(r["epsilon"])].add(int(_f(r["rounds"])))
        if by_eps:
            chosen[mech] = max(by_eps, key=lambda e: (len(by_eps[e]), e))
    multi = len({r["upstream"] for r in rows if r["strategy"] != "scratch"}) > 1
    series = _series(rows, "rounds", lambda r: chosen.get(r["mechanism"]) == _f(r["epsilon"]))
    fig, axes = plt.subplots(1, len(mechs), figsize=(5.2 * len(mechs), 4.2), squeeze=False)
    for ax, mech in zip(axes[0], mechs, strict=True):
        _draw(ax, series, mech, multi)
        eps = chosen.get(mech)
        ax.set_xlabel("global rounds T")
        ax.set_ylabel("test accuracy (%)")
        ax.set_title(f"{mech} mechanism, ε = {eps:g}" if eps is not None else mech)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    return _save(fig, out)
