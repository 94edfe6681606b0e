"""Fine-tuning strategies: which parameters a DP step trains, and so releases and noises.

- `ft` (full-tuning): every parameter is trained; each release has dimension p + n.
- `ht` (head-tuning): only the classifier head is trained. The backbone is frozen with
  `requires_grad=False`, so Opacus computes per-sample gradients, clips and adds noise for the
  head's parameters only (`DPOptimizer.params` keeps the parameters that require grad): the
  released vector, and the noise in it, has the head's dimension n.
- `ut` (unified-tuning, Ke et al. 2024; Pretrain-DPFL Definition 4): HT for the first T1 steps
  (or rounds), then FT.
- `bitfit` (Bu et al. 2022, DP bias-term fine-tuning): the bias terms of the whole backbone
  (every parameter named `bias`) plus the classifier head. A release of a few thousand
  coordinates instead of millions, so far less noise lands in the model than under FT, while
  the backbone still adapts (unlike HT).

A phase names a parameter set (`PHASE_PARAMS`); a strategy is one phase throughout or, for
UT, a first phase for T1 steps and a second after.

Why freezing and not masking: a masked gradient would still be clipped and noised in p + n
dimensions, which is FT's privacy/noise trade-off, not HT's. The privacy cost of one release
does not depend on its dimension (the clipped sensitivity is the same), so the accountant records
HT and FT steps alike; what changes is how much noise lands in the model.

The registry maps a name to a `Strategy`; `Strategy.schedule(total, t1_fraction)` gives the
`Schedule` (T1 and the phase of each step) that training loops consult.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from torch import nn

from dpadapter.models import get_head_params

HT, FT, BITFIT = "ht", "ft", "bitfit"
PHASES = (HT, FT)  # the phases UT switches between, and whose dimensions the T1 rule reads


def _head(model: nn.Module) -> list[nn.Parameter]:
    return list(get_head_params(model))


def _every(model: nn.Module) -> list[nn.Parameter]:
    return list(model.parameters())


def _biases_and_head(model: nn.Module) -> list[nn.Parameter]:
    keep = {id(p) for n, p in model.named_parameters() if n == "bias" or n.endswith(".bias")}
    keep |= {id(p) for p in get_head_params(model)}
    return [p for p in model.parameters() if id(p) in keep]


PHASE_PARAMS: dict[str, Callable[[nn.Module], list[nn.Parameter]]] = {
    HT: _head,
    FT: _every,
    BITFIT: _biases_and_head,
}


@dataclass(frozen=True)
class Schedule:
    """`total` steps of which the first `t1` are in phase `first` (HT unless said otherwise)
    and the rest in phase `then` (FT unless said otherwise)."""

    strategy: str
    total: int
    t1: int
    first: str = HT
    then: str = FT

    def __post_init__(self) -> None:
        if not 0 <= self.t1 <= self.total:
            raise ValueError(f"T1={self.t1} outside [0, {self.total}]")
        for ph in (self.first, self.then):
            if ph not in PHASE_PARAMS:
                raise ValueError(f"unknown phase {ph!r}; known: {sorted(PHASE_PARAMS)}")

    def phase(self, step: int) -> str:
        """Phase of the step with 0-based index `step`; from `total` on, the last phase stays
        (pure HT stays frozen after its last step)."""
        return self.first if step < self.t1 or self.t1 == self.total else self.then

    def phases(self) -> list[dict]:
        """The non-empty phases in order, as {"phase", "start", "steps"} (for metrics.json)."""
        out = []
        if self.t1 > 0:
            out.append({"phase": self.first, "start": 0, "steps": self.t1})
        if self.total > self.t1:
            out.append({"phase": self.then, "start": self.t1, "steps": self.total - self.t1})
        return out


@dataclass(frozen=True)
class Strategy:
    """A named rule for T1 given the total number of steps (and UT's configured fraction), and
    the phases it trains in: one throughout, or (first, then) switching at T1."""

    name: str
    t1_rule: Callable[[int, float | None], int]
    description: str
    phases: tuple[str, ...] = (HT, FT)

    def __post_init__(self) -> None:
        if not 1 <= len(self.phases) <= 2 or any(p not in PHASE_PARAMS for p in self.phases):
            raise ValueError(f"strategy {self.name!r}: one or two known phases, {self.phases}")

    def schedule(
        self, total: int, t1_fraction: float | None = None, t1: int | None = None
    ) -> Schedule:
        """Schedule over `total` steps; an explicit `t1` (UT only) overrides the fraction."""
        if t1 is not None:
            if self.name != "ut":
                raise ValueError(f"strategy {self.name!r} has a fixed T1; only 'ut' takes one")
            return self._schedule(total, int(t1))
        return self._schedule(total, self.t1_rule(total, t1_fraction))

    def _schedule(self, total: int, t1: int) -> Schedule:
        return Schedule(self.name, total, t1, self.phases[0], self.phases[-1])


STRATEGIES: dict[str, Strategy] = {}


def register_strategy(strategy: Strategy) -> Strategy:
    if strategy.name in STRATEGIES:
        raise KeyError(f"strategy {strategy.name!r} registered twice")
    STRATEGIES[strategy.name] = strategy
    return strategy


def _ut_t1(total: int, fraction: float | None) -> int:
    if fraction is None or not 0.0 <= fraction <= 1.0:
        raise ValueError(f"ut needs a T1 fraction in [0, 1], got {fraction!r}")
    return int(round(fraction * total))


register_strategy(Strategy("ft", lambda total, _f: 0, "full-tuning: every parameter", (FT,)))
register_strategy(
    Strategy("ht", lambda total, _f: total, "head-tuning: the classifier head only", (HT,))
)
register_strategy(Strategy("ut", _ut_t1, "unified-tuning: HT for T1 steps, then FT", (HT, FT)))
register_strategy(
    Strategy("bitfit", lambda total, _f: 0, "BiTFiT: every bias term and the head", (BITFIT,))
)


def get_strategy(name: str) -> Strategy:
    try:
        return STRATEGIES[name]
    except KeyError:
        raise KeyError(f"unknown strategy {name!r}; known: {sorted(STRATEGIES)}") from None


def trainable_params(
    model: nn.Module, strategy: str, phase: str | None = None
) -> list[nn.Parameter]:
    """Parameters trained (and released) by `strategy` in `phase`.

    `phase` defaults to the strategy's only phase (FT for `ft`, HT for `ht`, ...); `ut` needs
    it.
    """
    strat = get_strategy(strategy)
    if phase is None:
        if len(strat.phases) > 1:
            raise ValueError(f"{strategy} has two phases; pass phase={strat.phases}")
        phase = strat.phases[0]
    return phase_params(model, phase)


def phase_params(model: nn.Module, phase: str) -> list[nn.Parameter]:
    """The parameters phase `phase` trains, in `model.parameters()` order."""
    try:
        pick = PHASE_PARAMS[phase]
    except KeyError:
        raise ValueError(f"unknown phase {phase!r}; known: {sorted(PHASE_PARAMS)}") from None
    return pick(model)


def apply_phase(model: nn.Module, phase: str) -> list[nn.Parameter]:
    """Freeze everything `phase` does not train; return the trainable parameters.

    Works on the bare model or an Opacus GradSampleModule wrapping it (same parameters).
    """
    inner = getattr(model, "_module", model)
    keep = {id(p) for p in phase_params(inner, phase)}
    for p in inner.parameters():
        p.requires_grad_(id(p) in keep)
    return [p for p in inner.parameters() if id(p) in keep]


@contextmanager
def every_phase_trains(model: nn.Module, schedule: Schedule | None) -> Iterator[None]:
    """Inside: every parameter some phase of `schedule` trains requires grad (the union of
    its phases); after: the flags as they were.

    The checks made before the first private step (the per-sample self-test, the independence
    check's gradients) test the parameters that require grad: run at the first phase alone,
    they would pass unified tuning on its head while the backbone trains after T1.
    """
    if schedule is None:
        yield
        return
    inner = getattr(model, "_module", model)
    before = [(p, p.requires_grad) for p in inner.parameters()]
    for phase in {ph["phase"] for ph in schedule.phases()}:
        for p in phase_params(inner, phase):
            p.requires_grad_(True)
    try:
        yield
    finally:
        for p, flag in before:
            p.requires_grad_(flag)


def released_dims(model: nn.Module, phases: tuple[str, ...] = PHASES) -> dict[str, int]:
    """Dimension of one release (and of its noise) in each of `phases`: n for HT, p + n for FT,
    the biases and n for BiTFiT."""
    return {ph: released_dim(model, ph) for ph in phases}


def released_dim(model: nn.Module, phase: str) -> int:
    inner = getattr(model, "_module", model)
    return count_params(phase_params(inner, phase))


def count_params(params: list[nn.Parameter]) -> int:
    return sum(p.numel() for p in params)
