"""Figures of the paper's three comparisons, drawn from summary rows (lists of dicts from CSV).

Values may be strings, as `csv.DictReader` gives them; an empty cell counts as missing. Each
function writes exactly one PNG at `out` (creating its folder) and returns the path, so a
Snakemake rule can declare the file as its only output. Accuracies are stored as fractions in
the summaries and drawn in percent.
"""

from __future__ import annotations

import math
import textwrap
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display on pipeline hosts
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.ticker import FormatStrFormatter  # noqa: E402

Row = Mapping[str, Any]

_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">")


def _num(value: Any) -> float:
    """A float from a CSV cell; NaN for an empty or missing cell so it drops out of the plot."""
    if value is None:
        return math.nan
    if isinstance(value, str):
        value = value.strip()
        if value == "" or value.lower() in {"nan", "none", "null"}:
            return math.nan
    return float(value)


def _pct(value: Any) -> float:
    return 100.0 * _num(value)


def _ordered(values: Iterable[Any], order: Sequence[str] | None = None) -> list[str]:
    """Distinct values as strings, in `order` first and then in order of appearance."""
    seen = list(dict.fromkeys(str(v) for v in values))
    if not order:
        return seen
    first = [o for o in order if o in seen]
    return first + [v for v in seen if v not in first]


def _save(fig: Figure, out: str | Path) -> Path:
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=150, bbox_inches="tight", format="png")
    plt.close(fig)
    return path


def accuracy_vs_epsilon(
    rows: Sequence[Row],
    out: str | Path,
    *,
    algorithm: str | None = None,
    upstream_order: Sequence[str] | None = None,
    method_key: str = "upstream",
    task_key: str = "task",
    epsilon_key: str = "epsilon",
    mean_key: str = "mean_accuracy",
    std_key: str = "std_accuracy",
    facet_key: str = "strategy",
) -> Path:
    """Downstream DP accuracy against epsilon: one panel per task, one line per upstream method;
    one row of panels per tuning strategy where the rows hold several (`facet_key`).

    Error bars are the std over fine-tuning seeds. With several DP algorithms in the rows, pass
    `algorithm` to pick one, or the lines of different algorithms would be merged.
    """
    if algorithm is not None:
        rows = [r for r in rows if str(r.get("algorithm")) == algorithm]
    if not rows:
        raise ValueError("accuracy_vs_epsilon: no rows to plot")
    tasks = _ordered(r.get(task_key, "") for r in rows)
    methods = _ordered((r[method_key] for r in rows), upstream_order)
    facets = _ordered(r.get(facet_key, "") for r in rows)
    fig, axes = plt.subplots(
        len(facets), len(tasks), figsize=(4.2 * len(tasks), 3.6 * len(facets)), squeeze=False
    )
    for facet, ax_row in zip(facets, axes, strict=True):
        for ax, task in zip(ax_row, tasks, strict=True):
            cell = [
                r
                for r in rows
                if str(r.get(task_key, "")) == task and str(r.get(facet_key, "")) == facet
            ]
            _epsilon_panel(ax, cell, rows, methods, method_key, epsilon_key, mean_key, std_key)
            title = task or "downstream"
            ax.set_title(f"{title} · {facet}" if len(facets) > 1 else title)
    handles: dict[str, Any] = {}
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(label, handle)
    fig.legend(
        [handles[m] for m in methods if m in handles],
        [m for m in methods if m in handles],
        title="upstream",
        fontsize="small",
        loc="center left",
        bbox_to_anchor=(1.0, 0.5),
    )
    title = "DP fine-tuning accuracy vs ε"
    fig.suptitle(title + (f" ({algorithm})" if algorithm else ""))
    fig.tight_layout()
    return _save(fig, out)


def _epsilon_panel(ax, cell, rows, methods, method_key, epsilon_key, mean_key, std_key) -> None:
    """One panel of `accuracy_vs_epsilon`: a line per method over the rows of one cell."""
    for i, method in enumerate(methods):
        pts = sorted(
            (_num(r[epsilon_key]), _pct(r[mean_key]), _pct(r.get(std_key)))
            for r in cell
            if str(r[method_key]) == method
        )
        if not pts:
            continue
        eps, mean, std = zip(*pts, strict=True)
        yerr = [0.0 if math.isnan(s) else s for s in std]
        # Colour and marker follow the method, not the panel, so a method missing from one
        # task does not shift the others' colours.
        ax.errorbar(
            eps,
            mean,
            yerr=yerr,
            color=f"C{i % 10}",
            marker=_MARKERS[i % len(_MARKERS)],
            capsize=3,
            label=method,
        )
    ax.set_xscale("log")
    ax.set_xticks(sorted({_num(r[epsilon_key]) for r in rows}))
    ax.get_xaxis().set_major_formatter(FormatStrFormatter("%g"))
    ax.minorticks_off()
    ax.set_xlabel("privacy budget ε")
    ax.set_ylabel("test accuracy (%)")
    ax.grid(alpha=0.3)


def robustness_vs_accuracy(
    rows: Sequence[Row],
    out: str | Path,
    *,
    upstream_order: Sequence[str] | None = None,
    method_key: str = "upstream",
    accuracy_key: str = "public_test_accuracy",
    robust_key: str = "public_test_robust_accuracy",
    gamma_key: str = "gamma",
    noise_std: float | None = None,
    absent: Mapping[str, str] | None = None,
) -> Path:
    """Pre-trained models placed by robust accuracy (x) and accuracy (y), as in the paper's Fig. 6.

    One marker shape per method; a point is labelled with its gamma when the row has one, so a
    gamma sweep of sam and dpadapter reads as two curves through the trade-off. `absent`: the
    upstreams with nothing to place (name -> why, e.g. external weights, whose head knows other
    classes), written under the plot; with no row at all the figure is that note alone, so a
    config of external upstreams only still gets its figure (and its run finishes).
    """
    if not rows and not absent:
        raise ValueError("robustness_vs_accuracy: no rows to plot")
    fig, ax = plt.subplots(figsize=(5.2, 4.2))
    if absent:
        from dpadapter.ground.tables import NOT_MEASURED, absence_note

        note = absence_note(absent).removeprefix(f"{NOT_MEASURED}: ")
        note = textwrap.fill(note[0].upper() + note[1:], 70)
        if rows:
            fig.text(0.02, -0.02, note, fontsize="small", va="top", wrap=True)
        else:
            ax.axis("off")
            ax.text(0.5, 0.5, note, ha="center", va="center", fontsize="small")
            ax.set_title("Pre-trained models: robustness vs accuracy")
            return _save(fig, out)
    methods = _ordered((r[method_key] for r in rows), upstream_order)
    for i, method in enumerate(methods):
        mine = [r for r in rows if str(r[method_key]) == method]
        xs = [_pct(r[robust_key]) for r in mine]
        ys = [_pct(r[accuracy_key]) for r in mine]
        ax.scatter(
            xs,
            ys,
            color=f"C{i % 10}",
            marker=_MARKERS[i % len(_MARKERS)],
            s=55,
            label=method,
            zorder=3,
        )
        for r, x, y in zip(mine, xs, ys, strict=True):
            gamma = _num(r.get(gamma_key))
            if not math.isnan(gamma):
                ax.annotate(
                    f"γ={gamma:g}",
                    (x, y),
                    textcoords="offset points",
                    xytext=(5, 4),
                    fontsize="small",
                )
    noise = f" (weights + N(0, {noise_std:g}²))" if noise_std is not None else ""
    ax.set_xlabel(f"robust accuracy (%){noise}")
    ax.set_ylabel("accuracy (%)")
    ax.set_title("Pre-trained models: robustness vs accuracy")
    ax.grid(alpha=0.3)
    ax.legend(title="upstream", fontsize="small")
    return _save(fig, out)


def gamma_sweep(
    rows: Sequence[Row],
    out: str | Path,
    *,
    gamma_key: str = "gamma",
    accuracy_key: str = "public_test_accuracy",
    robust_key: str = "public_test_robust_accuracy",
    downstream_key: str = "mean_accuracy",
    std_key: str = "std_accuracy",
    task_key: str = "task",
    title: str = "DPAdapter: effect of the perturbation radius γ",
) -> Path:
    """Upstream accuracy, upstream robust accuracy and downstream accuracy against gamma (Fig. 5).

    Rows are long-format: one per (gamma, task) with the downstream mean (and std), each also
    carrying the upstream metrics of the model pre-trained with that gamma; rows without a
    downstream value only contribute upstream points. Left panel: the pre-trained model; right
    panel: one line per downstream task.
    """
    pts = [r for r in rows if not math.isnan(_num(r.get(gamma_key)))]
    if not pts:
        raise ValueError(f"gamma_sweep: no row has a {gamma_key!r} value")
    upstream: dict[float, tuple[float, float]] = {}
    downstream: dict[str, list[tuple[float, float, float]]] = defaultdict(list)
    for r in pts:
        g = _num(r[gamma_key])
        upstream.setdefault(g, (_pct(r.get(accuracy_key)), _pct(r.get(robust_key))))
        mean = _pct(r.get(downstream_key))
        if not math.isnan(mean):
            downstream[str(r.get(task_key, "downstream"))].append((g, mean, _pct(r.get(std_key))))
    fig, (left, right) = plt.subplots(1, 2, figsize=(9.5, 3.8))
    gs = sorted(upstream)
    left.plot(gs, [upstream[g][0] for g in gs], marker="o", label="accuracy")
    left.plot(gs, [upstream[g][1] for g in gs], marker="s", label="robust accuracy")
    left.set_title("upstream (public test set)")
    for i, (task, vals) in enumerate(sorted(downstream.items())):
        vals.sort()
        g, mean, std = zip(*vals, strict=True)
        yerr = [0.0 if math.isnan(s) else s for s in std]
        right.errorbar(
            g, mean, yerr=yerr, marker=_MARKERS[i % len(_MARKERS)], capsize=3, label=task
        )
    right.set_title("downstream (DP fine-tuning)")
    for ax in (left, right):
        ax.set_xlabel("perturbation radius γ")
        ax.set_ylabel("accuracy (%)")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    fig.suptitle(title)
    fig.tight_layout()
    return _save(fig, out)
