"""The `audit` section: the empirical privacy audit (`dpadapter.audit`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dpadapter.settings.sections import tuplify


@dataclass(frozen=True)
class AuditConfig:
    """Empirical privacy audit (`dpadapter.audit`; Steinke, Nasr & Jagielski 2023, one run).

    One run per algorithm x epsilon on `task` (None = the first task) with `canaries` inserted,
    each with probability 1/2; empty `algorithms` = every registered one. Training settings are
    `finetune`'s (`epochs` None = finetune.epochs; `n_real` None = the whole training split).
    Each of `scores` x `guesses` (top-k / bottom-k) is one test; the reported lower bound is
    their maximum at `confidence` overall (Bonferroni). `federated`: federated mechanisms
    audited per client (the `federated` section's setting, canaries in client 0).
    """

    algorithms: tuple[str, ...] = ()
    epsilons: tuple[float, ...] = (1.0, 4.0)
    task: str | None = None
    canaries: int = 2000
    canary_scale: float = 10.0
    guesses: tuple[int, ...] = (200, 400, 600)
    scores: tuple[str, ...] = ("whitebox", "blackbox")
    confidence: float = 0.95
    epochs: int | None = None
    n_real: int | None = None
    seed: int = 0
    federated: tuple[str, ...] = ("gaussian", "laplace")  # mechanisms audited (client 0)

    def problems(self) -> list[str]:
        """What the section gets wrong on its own (`key: text`); its names against the
        registry and the tasks are `dpadapter.audit.checks`'."""
        if any(2 * k > self.canaries for k in self.guesses):
            return [f"audit.guesses: every k needs 2k <= audit.canaries = {self.canaries}"]
        return []


def parse_audit(d: dict[str, Any]) -> AuditConfig:
    """The `audit` section of a raw config."""
    out = tuplify(d, ("algorithms", "epsilons", "guesses", "scores", "federated"))
    if "epsilons" in out:
        out["epsilons"] = tuple(float(e) for e in out["epsilons"])
    return AuditConfig(**out)
