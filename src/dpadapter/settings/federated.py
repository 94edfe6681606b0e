"""The `federated` section: DP federated fine-tuning (`dpadapter.federated`, Pretrain-DPFL).

Checked here: what the section tells alone (`FederatedConfig.problems`); the names it reads
from the rest of the config are `dpadapter.federated.checks`'.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from dpadapter.settings.grid import grid, union
from dpadapter.settings.sections import tuplify


@dataclass(frozen=True)
class FedMechanismConfig:
    """One client-side DP mechanism of the federated stage (`dpadapter.federated`).

    `max_grad_norm` is the per-example clipping bound: l2 (xi_2) for Gaussian, l1 (xi_1) for
    Laplace. `sample_rate` is the Gaussian clients' Poisson rate; Laplace (Theorem 1) always
    uses every example, so its rate must be 1.
    """

    epsilons: tuple[float, ...]
    max_grad_norm: float
    lr: float
    sample_rate: float = 1.0
    estimate_fraction: float = 0.1  # share of epsilon paying for the T1 rule's estimates
    # bound inside the estimates, in the training clipping's unit; None = max_grad_norm
    estimate_clip: float | None = None


def _fed_gaussian() -> FedMechanismConfig:
    return FedMechanismConfig(
        epsilons=(0.5, 2.0, 8.0), max_grad_norm=1.0, lr=1.5, sample_rate=0.2, estimate_fraction=0.2
    )


def _fed_laplace() -> FedMechanismConfig:
    return FedMechanismConfig(
        epsilons=(25.0, 100.0, 400.0),
        max_grad_norm=10.0,
        lr=1.0,
        estimate_fraction=0.05,
        estimate_clip=1.0,
    )


@dataclass(frozen=True)
class FederatedConfig:
    """DP federated fine-tuning (Pretrain-DPFL): FedSGD/FedAvg over Dirichlet-split clients.

    Grid: each pre-trained upstream x `strategies` (ht, ft, ut; bitfit on request), plus
    `scratch` (FT from the random-init checkpoint), x mechanism x its epsilons x seeds, at
    `rounds` rounds; `rounds_sweep` adds the same strategies at other round counts, at
    `sweep_epsilons[mechanism]`. `ut_t1` is "rule" (Theorems 2-3 from privately estimated
    constants; the mechanism's `estimate_fraction` of the budget pays for the estimate) or a
    fraction of the rounds.
    """

    task: str | None = None
    upstreams: tuple[str, ...] = ()
    strategies: tuple[str, ...] = ("scratch", "ht", "ft", "ut")
    mechanisms: tuple[str, ...] = ("gaussian", "laplace")
    seeds: tuple[int, ...] = (0, 1)
    clients: int = 10
    dirichlet_alpha: float = 1.0
    min_client_size: int = 20
    split_seed: int = 0
    rounds: int = 20
    local_steps: int = 1
    ut_t1: str | float = "rule"
    estimate_directions: int = 2
    estimate_radius: float = 0.01
    estimate_points: int = 1  # models along the trajectory the T1 rule's constants come from
    eval_every: int = 5
    rounds_sweep: tuple[int, ...] = (10, 40)
    sweep_seeds: tuple[int, ...] = ()  # seeds of the rounds sweep; () = `seeds`
    sweep_epsilons: dict[str, float] = field(
        default_factory=lambda: {"gaussian": 2.0, "laplace": 100.0}
    )
    gaussian: FedMechanismConfig = field(default_factory=_fed_gaussian)
    laplace: FedMechanismConfig = field(default_factory=_fed_laplace)

    def mechanism(self, name: str) -> FedMechanismConfig:
        return {"gaussian": self.gaussian, "laplace": self.laplace}[name]

    def pretrained(self, methods: tuple[str, ...]) -> tuple[str, ...]:
        """Upstreams fine-tuned by ht/ft/ut: as configured, else every method but scratch."""
        return self.upstreams or tuple(m for m in methods if m != "scratch")

    def jobs(self, methods: tuple[str, ...]) -> list[tuple[str, str, str, float, int, int]]:
        """Every (upstream, strategy, mechanism, epsilon, rounds, seed), no duplicates.

        `scratch` runs once, on the `scratch` checkpoint, whatever the upstreams.
        """
        cells: list[tuple[str, float, int]] = [
            (m, float(e), self.rounds) for m in self.mechanisms for e in self.mechanism(m).epsilons
        ]
        for t in self.rounds_sweep:
            for m in self.mechanisms:
                if m in self.sweep_epsilons:
                    cells.append((m, float(self.sweep_epsilons[m]), int(t)))
        pairs = [("scratch", "scratch")] if "scratch" in self.strategies else []
        tuned = [s for s in self.strategies if s != "scratch"]
        pairs += grid(self.pretrained(methods), tuned)
        return union(
            *(
                [(u, s, m, e, t, seed) for (u, s), seed in grid(pairs, self._seeds(t))]
                for m, e, t in cells
            )
        )

    def _seeds(self, rounds: int) -> list[int]:
        """The seeds of the runs of `rounds` rounds: `seeds`, or the rounds sweep's own."""
        seeds = self.seeds if rounds == self.rounds else (self.sweep_seeds or self.seeds)
        return [int(s) for s in seeds]

    def problems(self) -> list[str]:
        """What the section gets wrong on its own (`key: text`); the names it reads from the
        rest of the config are `dpadapter.federated.checks`'."""
        out = []
        missing = [m for m in self.mechanisms if m not in self.sweep_epsilons]
        for m in missing if self.rounds_sweep else []:
            out.append(f"federated.sweep_epsilons: rounds_sweep needs an epsilon for {m!r}")
        if self.laplace.sample_rate != 1.0:
            out.append("federated.laplace.sample_rate: must be 1 (Theorem 1 uses every example)")
        if isinstance(self.ut_t1, str) and self.ut_t1 != "rule":
            out.append("federated.ut_t1: 'rule' or a fraction in [0, 1]")
        # the T1 rule's points: rounds 0, s, .., (m-1)s, s = rounds // (2m)
        m = self.estimate_points
        for t in sorted({self.rounds, *self.rounds_sweep}):
            if self.ut_t1 == "rule" and (m - 1) * max(1, t // (2 * m)) > t - 1:
                out.append(f"federated.estimate_points: {m} points do not fit in {t} rounds")
        return out


def parse_federated(d: dict[str, Any], methods: tuple[str, ...]) -> FederatedConfig:
    """The `federated` section of a raw config whose `pretrain.methods` are `methods`."""
    keys = ("upstreams", "strategies", "mechanisms", "seeds", "rounds_sweep", "sweep_seeds")
    out = tuplify(d, keys)
    if "scratch" not in methods:  # the default strategies: scratch only with its checkpoint
        out.setdefault("strategies", ("ht", "ft", "ut"))
    for m in ("gaussian", "laplace"):
        if m in out:
            mech = tuplify(out[m], ("epsilons",))
            if "epsilons" in mech:
                mech["epsilons"] = tuple(float(e) for e in mech["epsilons"])
            base = _fed_gaussian() if m == "gaussian" else _fed_laplace()
            out[m] = dataclasses.replace(base, **mech)
    if "sweep_epsilons" in out:
        out["sweep_epsilons"] = {k: float(v) for k, v in out["sweep_epsilons"].items()}
    return FederatedConfig(**out)
