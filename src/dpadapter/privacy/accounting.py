"""Privacy ledger: every Gaussian release actually made, and the epsilon it implies.

A run records each release as it happens (through Opacus' optimizer step hook, so skipped
virtual steps are never counted and resumed runs carry their past). The reported epsilon is
recomputed from this history alone with Opacus' accountants; `pld_epsilon` is an independent
recomputation with Google's dp-accounting, used by the tests and available to anyone holding a
metrics.json.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
import warnings
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dpadapter.privacy import genuine, rdp_memo

EPS_ERROR = 0.01  # PRV discretisation error; Opacus returns the upper end of the bound


@dataclass(frozen=True)
class Segment:
    """`steps` Poisson-subsampled Gaussian releases with the same sigma and sampling rate."""

    noise_multiplier: float
    sample_rate: float
    steps: int

    def as_tuple(self) -> tuple[float, float, int]:
        return (self.noise_multiplier, self.sample_rate, self.steps)


def _accountant(name: str):
    from opacus.accountants import create_accountant
    from opacus.accountants.analysis import rdp

    rdp_memo.install(rdp)  # PRV's domain bound and RDP both compute through it
    return create_accountant(name)


def accountant_version() -> str:
    """Opacus' version: its accountants' numerics are part of every memoised sigma's key (read
    from the installed package's metadata: importing Opacus costs over a second)."""
    from importlib.metadata import version

    return version("opacus")


def epsilon_from_history(history: list[Segment], delta: float, accountant: str = "prv") -> float:
    """Upper bound on epsilon for the composed history (Opacus PRV or RDP).

    Always computed: no value is read from a memo or a file, since every epsilon the pipeline
    prints, records or checks must come from the accountant and this history (a results folder's
    stale or edited memo once supplied a run's "checked" epsilon). Only Opacus' pure per-order
    RDP function is memoised, in this process (`rdp_memo`).
    """
    return _epsilon(history, delta, accountant)


def _epsilon(history: list[Segment], delta: float, accountant: str) -> float:
    history = [s for s in history if s.steps > 0]
    if not history:
        return 0.0
    if any(s.noise_multiplier <= 0 for s in history):
        return float("inf")
    acc = _accountant(accountant)
    acc.history = [s.as_tuple() for s in history]
    if accountant == "prv":
        with _quiet_rdp_inside_prv():
            return float(acc.get_epsilon(delta=delta, eps_error=EPS_ERROR))
    return float(acc.get_epsilon(delta=delta))


# Opacus' RDP analysis warns when the best order is at either end of its range: a looser bound
# than more orders would give. Under RDP that is the reported epsilon, and the warning stays.
_RDP_ORDER_WARNING = r"Optimal order is the (smallest|largest) alpha"


@contextmanager
def _quiet_rdp_inside_prv():
    """Opacus' PRV accountant sizes its discretisation domain with an RDP bound at a tiny
    delta (`analysis/prv/domain.py`), whose best order is nearly always the largest: each PRV
    job's log began with RDP's advice to widen the orders, about a bound that only sizes a grid
    and is not the epsilon reported (issue 50). Only that warning, from that module, and only
    around PRV."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore",
            message=_RDP_ORDER_WARNING,
            category=UserWarning,
            module=r"opacus\.accountants\.analysis\.rdp\Z",
        )
        yield


# Opacus' RDPAccountant.DEFAULT_ALPHAS (tests/privacy check that they are equal).
RDP_ORDERS = [1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64))


def rdp_epsilon(history: list[Segment], delta: float) -> float:
    """`epsilon_from_history(history, delta, "rdp")`, computed without importing Opacus.

    Opacus' package imports torch (~2 s); its RDP analysis is a module of numpy and scipy
    only, so the config validation, which runs while the workflow parses, loads that module
    by itself and composes as its `RDPAccountant.get_epsilon` does: the same number, bit for bit.
    """
    history = [s for s in history if s.steps > 0]
    if not history:
        return 0.0
    if any(s.noise_multiplier <= 0 for s in history):
        return float("inf")
    analysis = _rdp_analysis()
    rdp = sum(  # a list, as Opacus sums it
        [
            analysis.compute_rdp(
                q=s.sample_rate,
                noise_multiplier=s.noise_multiplier,
                steps=s.steps,
                orders=RDP_ORDERS,
            )
            for s in history
        ]
    )
    eps, _ = analysis.get_privacy_spent(orders=RDP_ORDERS, rdp=rdp, delta=delta)
    return float(eps)


@functools.cache
def _rdp_analysis():
    """Opacus' `accountants/analysis/rdp.py`, loaded without running Opacus' `__init__`, with
    the per-order memo in place."""
    module = _load_rdp_analysis()
    rdp_memo.install(module)
    return module


def _load_rdp_analysis():
    if "opacus" in sys.modules:  # already paid for: the ordinary module
        from opacus.accountants.analysis import rdp

        return rdp
    spec = importlib.util.find_spec("opacus")  # locates the package, imports nothing
    path = Path(spec.submodule_search_locations[0]) / "accountants" / "analysis" / "rdp.py"
    if not path.is_file():  # another layout: the ordinary import, slow but right
        from opacus.accountants.analysis import rdp

        return rdp
    loader_spec = importlib.util.spec_from_file_location("dpadapter._opacus_rdp_analysis", path)
    module = importlib.util.module_from_spec(loader_spec)
    loader_spec.loader.exec_module(module)
    return module


def pld_epsilon(history: list[Segment], delta: float, discretization: float = 1e-4) -> float:
    """Independent recomputation with dp-accounting's PLD accountant (Poisson subsampling)."""
    import dp_accounting

    acc = dp_accounting.pld.PLDAccountant(value_discretization_interval=discretization)
    for s in history:
        if s.steps <= 0:
            continue
        event = dp_accounting.PoissonSampledDpEvent(
            s.sample_rate, dp_accounting.GaussianDpEvent(s.noise_multiplier)
        )
        acc.compose(event, s.steps)
    return float(acc.get_epsilon(delta))


class PrivacyLedger:
    """Append-only record of releases; consecutive identical releases merge into one segment.

    `epsilon()` asks the accountant each time (`epsilon_from_history`): what a run prints per
    epoch and checks at its end is never a remembered number.
    """

    def __init__(
        self,
        delta: float,
        accountant: str = "prv",
        history: list[Segment] | None = None,
    ):
        self.delta = delta
        self.accountant = accountant
        self.history: list[Segment] = list(history or [])

    def record(self, noise_multiplier: float, sample_rate: float, steps: int = 1) -> None:
        if self.history:
            last = self.history[-1]
            if last.noise_multiplier == noise_multiplier and last.sample_rate == sample_rate:
                self.history[-1] = Segment(noise_multiplier, sample_rate, last.steps + steps)
                return
        self.history.append(Segment(float(noise_multiplier), float(sample_rate), int(steps)))

    @property
    def steps(self) -> int:
        return sum(s.steps for s in self.history)

    def epsilon(self) -> float:
        return epsilon_from_history(self.history, self.delta, self.accountant)

    def state_dict(self) -> dict[str, Any]:
        return {
            "delta": self.delta,
            "accountant": self.accountant,
            "history": [asdict(s) for s in self.history],
        }

    @classmethod
    def from_state_dict(cls, d: dict[str, Any]) -> PrivacyLedger:
        return cls(d["delta"], d["accountant"], [Segment(**s) for s in d["history"]])


genuine.record(globals())  # last: the names as imported, which the process memo requires
