"""Figure of the audit: measured lower bound against claimed epsilon, the diagonal drawn."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on pipeline hosts
import matplotlib.pyplot as plt  # noqa: E402

_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">")


def lower_bound_vs_claim(table: list[dict], out: str | Path) -> Path:
    """One marker per algorithm; a point above the diagonal would refute that run's claim."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(5, 4.5))
    algos = list(dict.fromkeys(r["algorithm"] for r in table))
    top = max([float(r["claimed_epsilon"]) for r in table] + [1.0]) * 1.1
    ax.plot([0, top], [0, top], "k--", lw=1, label="ε_lb = claimed ε")
    for i, a in enumerate(algos):
        pts = sorted(
            (float(r["claimed_epsilon"]), float(r["epsilon_lb"]))
            for r in table
            if r["algorithm"] == a
        )
        ax.plot(
            [p[0] for p in pts], [p[1] for p in pts], marker=_MARKERS[i % len(_MARKERS)], label=a
        )
    ax.set_xlim(0, top)
    ax.set_ylim(0, top)
    ax.set_xlabel("claimed ε (ledger)")
    ax.set_ylabel("ε lower bound (one-run audit, 95%)")
    ax.set_title("Empirical privacy audit")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
