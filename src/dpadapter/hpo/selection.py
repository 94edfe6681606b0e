"""Private release of each sweep's winner: which trial had the best validation accuracy.

The validation split is carved from the private training pool, so its accuracy counts are a
statistic of private data and the choice they drive is a release. The score of trial i is
c_i, its number of correct validation predictions. Under add/remove-one neighbours (the
relation every accountant in this project uses), one validation example changes each c_i by at
most 1 and all in the same direction (adding an example can only add correct predictions), so
the count vector has L-inf sensitivity 1, L2 sensitivity sqrt(n), and is monotone.

Mechanisms (`hpo.selection`):
- `exponential`: report the argmax of eps * c_i + Gumbel(1) noise, i.e. sample i with
  probability proportional to exp(eps * c_i). For monotone scores of sensitivity 1 this is
  eps-DP (Dwork & Roth 2014, Sec. 3.4, McSherry & Talwar 2007); only the index is released.
  Accounted as the generic (eps, 0)-DP privacy loss distribution, which dominates every
  eps-DP mechanism.
- `gaussian`: release c_i + N(0, s^2) for every trial and take the argmax; the vector is one
  Gaussian mechanism with L2 sensitivity sqrt(n), i.e. noise multiplier s / sqrt(n). The noisy
  accuracies may then be published.
- `none`: raw argmax, NOT accounted: valid only under the stated assumption that the
  validation split is a held-out set whose privacy is not claimed.

Composition with the training runs is sequential (a valid upper bound). A validation example is
never a training example, so parallel composition would also apply; it is not used.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

MECHANISMS = ("exponential", "gaussian", "none")
NOT_ACCOUNTED = (
    "selection by the raw validation argmax is NOT accounted: the validation split is treated as "
    "a disjoint held-out set whose privacy is not claimed; the epsilon covers the training "
    "examples only"
)


@dataclass(frozen=True)
class SelectionMechanism:
    """How a sweep's winner is released, and what that costs."""

    kind: str
    epsilon: float = 0.05
    noise_std: float = 25.0

    def __post_init__(self) -> None:
        if self.kind not in MECHANISMS:
            raise ValueError(f"unknown selection {self.kind!r}; known: {MECHANISMS}")
        if self.kind == "exponential" and not self.epsilon > 0:
            raise ValueError("selection_epsilon must be > 0")
        if self.kind == "gaussian" and not self.noise_std > 0:
            raise ValueError("selection_noise_std must be > 0")

    @property
    def accounted(self) -> bool:
        return self.kind != "none"

    def release(self, n: int) -> dict[str, Any]:
        """The accounting record of one selection among n trials (stored in sweep json)."""
        if self.kind == "exponential":
            return {"mechanism": "exponential", "pure_epsilon": self.epsilon, "candidates": n}
        if self.kind == "gaussian":
            return {
                "mechanism": "gaussian",
                "noise_std": self.noise_std,
                "l2_sensitivity": math.sqrt(n),
                "noise_multiplier": self.noise_std / math.sqrt(n),
                "candidates": n,
            }
        return {"mechanism": "none", "candidates": n, "assumption": NOT_ACCOUNTED}

    def select(self, counts: Sequence[int], rng: np.random.Generator) -> tuple[int, dict[str, Any]]:
        """(index of the chosen trial, what is published about the choice)."""
        c = np.asarray(counts, dtype=float)
        if c.ndim != 1 or len(c) == 0:
            raise ValueError("need at least one trial to select from")
        if self.kind == "exponential":
            scores = self.epsilon * c + rng.gumbel(size=len(c))
            return int(np.argmax(scores)), {}
        if self.kind == "gaussian":
            noisy = c + rng.normal(0.0, self.noise_std, size=len(c))
            return int(np.argmax(noisy)), {"noisy_counts": [float(v) for v in noisy]}
        return int(np.argmax(c)), {"raw_counts": [int(v) for v in c]}


def selection_of(cfg) -> SelectionMechanism:
    """The accounted (or, with `none`, the stated unaccounted) selection the config asks for."""
    h = cfg.hpo
    return SelectionMechanism(h.selection, h.selection_epsilon, h.selection_noise_std)
