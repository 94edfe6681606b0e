"""Privacy ledger: every Gaussian release actually made, and the epsilon it implies.

A run records each release as it happens (through Opacus' optimizer step hook, so skipped
virtual steps are never counted and resumed runs carry their past). The reported epsilon is
recomputed from this history alone with Opacus' accountants; `pld_epsilon` is an independent
recomputation with Google's dp-accounting, used by the tests and available to anyone holding a
metrics.json.
"""

from __future__ import annotations

import fcntl
import functools
import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

EPS_ERROR = 0.01  # PRV discretisation error; Opacus returns the upper end of the bound
# Calibration range. Below SIGMA_MIN the noise is negligible (epsilon in the hundreds for any
# usual grid) and PRV's numerics overflow (inf, ~10 s an evaluation): a target epsilon that
# only such a sigma reaches is refused rather than searched for (epsilon 1e5 once searched for
# 66 minutes). Above SIGMA_MAX the budget is too small for any training.
SIGMA_MIN = 0.3
SIGMA_MAX = 1e4
CALIBRATION_SECONDS = 300.0  # wall-clock bound of one calibration
CALIBRATION_ITERATIONS = 100


class CalibrationError(ValueError):
    """No noise multiplier in the calibration range meets the target; the message says why."""


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

    return create_accountant(name)


def epsilon_from_history(history: list[Segment], delta: float, accountant: str = "prv") -> float:
    """Upper bound on epsilon for the composed history (Opacus PRV or RDP)."""
    history = [s for s in history if s.steps > 0]
    if not history:
        return 0.0
    if any(s.noise_multiplier <= 0 for s in history):
        return float("inf")
    acc = _accountant(accountant)
    acc.history = [s.as_tuple() for s in history]
    if accountant == "prv":
        return float(acc.get_epsilon(delta=delta, eps_error=EPS_ERROR))
    return float(acc.get_epsilon(delta=delta))


def calibrate_sigma(
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    accountant: str = "prv",
    cache: str | Path | None = None,
) -> float:
    """Smallest sigma (to Opacus' tolerance) whose epsilon does not exceed the target.

    The bisection costs seconds with PRV and every job of a grid repeats the same few, so the
    results are cached in a JSON file keyed by every input (the runs still check the spent
    epsilon against the target from their own recorded history).
    """
    key = json.dumps([target_epsilon, delta, sample_rate, steps, accountant, EPS_ERROR])
    return cached(
        cache, key, lambda: _calibrate(target_epsilon, delta, sample_rate, steps, accountant)
    )


def cached(cache: str | Path | None, key: str, compute: Callable[[], float]) -> float:
    """`compute()`, memoised under `key` in the JSON file `cache` (None: no cache).

    Shared by every calibration (constant sigma, AdpAlloc's sigma_0, the federated joint sigma):
    concurrent jobs of a grid update the file under a lock and replace it atomically.
    """
    if cache is None:
        return compute()
    hit = _read_cache(Path(cache)).get(key)
    if hit is not None:
        return float(hit)
    value = compute()
    _write_cache(Path(cache), key, value)
    return value


def _read_cache(path: Path) -> dict[str, float]:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def _write_cache(path: Path, key: str, sigma: float) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        data = _read_cache(path)
        data[key] = sigma
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, path)


def _calibrate(
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    accountant: str,
    max_seconds: float = CALIBRATION_SECONDS,
) -> float:
    """Opacus' `get_noise_multiplier` search, bounded in sigma, iterations and time.

    Written here because Opacus' search has no lower bound on sigma, no iteration cap and no
    time limit, and ends only within an absolute tolerance: a huge target epsilon drives it to
    sigma ~ 0 where the accountant overflows and it never converges. The search itself (double
    from 20, then bisect from 0 to an absolute tolerance of 0.005) is Opacus', so sigma is the
    same as before for every target it could reach.
    """
    import math
    import time

    from opacus.accountants import create_accountant

    acc = create_accountant(mechanism=accountant)
    kwargs: dict[str, Any] = {"eps_error": EPS_ERROR} if accountant == "prv" else {}
    tolerance, started = 0.005, time.monotonic()
    where = (
        f"target epsilon {target_epsilon:g} (delta {delta:g}, sample rate {sample_rate:.4g}, "
        f"{steps} steps, {accountant})"
    )

    def eps(sigma: float) -> float:
        if time.monotonic() - started > max_seconds:
            raise CalibrationError(
                f"sigma calibration for {where} did not converge in {max_seconds:.0f} s; "
                "use a smaller epsilon, or privacy.accountant: rdp"
            )
        acc.history = [(sigma, sample_rate, steps)]
        value = float(acc.get_epsilon(delta=delta, **kwargs))
        return math.inf if math.isnan(value) else value

    floor = eps(SIGMA_MIN)
    if floor <= target_epsilon:
        raise CalibrationError(
            f"{where} is reachable only with sigma < {SIGMA_MIN} (sigma {SIGMA_MIN} already "
            f"gives epsilon {floor:.4g}): the noise would be negligible and the accountant is "
            f"not reliable there. Use an epsilon below {floor:.4g}, or train without DP "
            "(the `standard` upstream model is non-private)."
        )
    sigma_low, sigma_high, eps_high = 0.0, 10.0, math.inf
    while eps_high > target_epsilon:
        sigma_high *= 2
        if sigma_high > SIGMA_MAX:
            raise CalibrationError(
                f"{where} needs sigma > {SIGMA_MAX:g}: the budget is too small for this many "
                "steps; raise epsilon or lower finetune.epochs"
            )
        eps_high = eps(sigma_high)
    for _ in range(CALIBRATION_ITERATIONS):
        if target_epsilon - eps_high <= tolerance:
            return float(sigma_high)
        sigma = (sigma_low + sigma_high) / 2
        value = eps(sigma)
        if value < target_epsilon:
            sigma_high, eps_high = sigma, value
        else:
            sigma_low = sigma
    raise CalibrationError(
        f"sigma calibration for {where} did not converge in {CALIBRATION_ITERATIONS} steps"
    )


@functools.lru_cache(maxsize=256)
def max_reachable_epsilon(delta: float, sample_rate: float, steps: int) -> float:
    """An upper bound (RDP, fast) on the largest epsilon `calibrate_sigma` can calibrate to.

    The config validation refuses larger targets before any job: RDP's epsilon at SIGMA_MIN
    is at least PRV's, so a target above it is out of reach under either accountant.
    """
    import warnings

    with warnings.catch_warnings():  # "optimal order is the smallest alpha": an upper bound
        warnings.simplefilter("ignore", UserWarning)
        return epsilon_from_history([Segment(SIGMA_MIN, sample_rate, steps)], delta, "rdp")


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
    """Append-only record of releases; consecutive identical releases merge into one segment."""

    def __init__(self, delta: float, accountant: str = "prv", history: list[Segment] | None = None):
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
