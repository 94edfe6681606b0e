"""The `hpo` section: private HPO with the linear scaling rule (`dpadapter.hpo`).

Checked here: what the section tells alone (`HPOConfig.__post_init__`, `HPOConfig.problems`);
its names against the registries and the config are `dpadapter.hpo.checks`'.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dpadapter.settings.errors import ConfigError
from dpadapter.settings.sections import tuplify


@dataclass(frozen=True)
class HPOConfig:
    """Private HPO with the linear scaling rule (`dpadapter.hpo`, Panda et al. 2024).

    Trials at the small per-run budgets `sweep_epsilons` (n = `trials_per_sweep` each) pick the
    best total step size r = lr * steps at each budget, a line (or quadratic) through those
    points predicts r for the final run, and the final run's budget is whatever keeps the
    composition of every trial, every selection and the final run within `target_epsilon`.
    Empty `upstreams`/`tasks` mean all of them. `steps` count optimizer steps (releases).
    `monotone` floors r* at the sweeps' best r (the rule's prior: r does not fall as eps grows).
    """

    upstreams: tuple[str, ...] = ()
    tasks: tuple[str, ...] = ()
    algorithms: tuple[str, ...] = ("dpsgd",)
    seeds: tuple[int, ...] = (0,)
    target_epsilon: float = 1.0
    sweep_epsilons: tuple[float, ...] = (0.1, 0.2)
    trials_per_sweep: int = 3
    fit: str = "linear"
    monotone: bool = False
    lr_range: tuple[float, float] = (0.05, 2.0)
    steps_range: tuple[int, int] = (10, 60)
    grid_size: int = 8
    selection: str = "exponential"
    selection_epsilon: float = 0.05
    selection_noise_std: float = 25.0
    # `regime`: "network" fine-tunes the checkpoint with the registered algorithm (one job per
    # trial); "linear-probe" is the paper's regime (`dpadapter.hpo.probe`): a zero-initialised
    # linear head on frozen features, full-batch DP-GD with `momentum`, at every
    # `target_epsilons` budget, the oracle over `oracle_seeds` training seeds per grid point.
    regime: str = "linear-probe"
    strategy: str | None = None  # network regime: ft/ht/ut/bitfit; None = finetune.strategy
    target_epsilons: tuple[float, ...] = (1.0,)  # the paper's total budget; sweeps must be below
    oracle_seeds: int = 3
    momentum: float = 0.9
    max_grad_norm: float = 1.0

    def __post_init__(self) -> None:
        if self.regime != "linear-probe":
            return
        low = min(self.target_epsilons, default=None)
        if low is None:
            raise ConfigError("invalid config:\n  hpo.target_epsilons: linear-probe needs >= 1")
        if self.sweep_epsilons and max(self.sweep_epsilons) >= low:
            raise ConfigError(
                "invalid config:\n  hpo.sweep_epsilons: every sweep budget must be below the "
                f"smallest of hpo.target_epsilons ({low})"
            )

    def problems(self) -> list[str]:
        """What the section gets wrong on its own (`key: text`); names are `hpo.checks`'."""
        out, eps = [], list(self.sweep_epsilons)
        if eps != sorted(set(eps)):
            out.append("hpo.sweep_epsilons: must be strictly increasing")
        if eps and eps[-1] >= self.target_epsilon:
            out.append("hpo.sweep_epsilons: every sweep budget must be below hpo.target_epsilon")
        need = {"linear": 2, "quadratic": 3}.get(self.fit, 2)
        if len(eps) < need:
            out.append(f"hpo.sweep_epsilons: a {self.fit} fit needs at least {need} sweep budgets")
        if not 0 < self.lr_range[0] <= self.lr_range[1]:
            out.append("hpo.lr_range: must be [min, max] with 0 < min <= max")
        if not 1 <= self.steps_range[0] <= self.steps_range[1]:
            out.append("hpo.steps_range: must be [min, max] with 1 <= min <= max")
        return out

    @property
    def budgets(self) -> tuple[float, ...]:
        """The total budgets the HPO is run for: one per target."""
        return self.target_epsilons if self.regime == "linear-probe" else (self.target_epsilon,)


def parse_hpo(d: dict[str, Any]) -> HPOConfig:
    """The `hpo` section of a raw config."""
    keys = ("upstreams", "tasks", "algorithms", "seeds", "sweep_epsilons")
    keys += ("lr_range", "steps_range", "target_epsilons")
    out = tuplify(d, keys)
    for k in ("sweep_epsilons", "target_epsilons"):
        if k in out:
            out[k] = tuple(float(e) for e in out[k])
    return HPOConfig(**out)
