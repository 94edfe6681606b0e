"""The privacy cost of a whole HPO: every trial, every selection and the final run, composed.

All releases are composed with dp-accounting's privacy loss distributions (PLD, pessimistic
estimates, so every epsilon is an upper bound): each recorded history segment is `steps`
Poisson-subsampled Gaussian releases, each selection is the PLD of its mechanism
(`selection.py`). Theorem 4.1's mu-composition sqrt(n mu1^2 + n mu2^2 + muf^2) is exact only for
full-batch training; with Poisson sampling it is not, so it is not used.

Adaptivity: the final run's r depends on the trials' results, so its privacy parameters must
not. Every trial's (sigma, q, T) is fixed by the config and the seed before any data is read,
and the final run's noise is fixed whatever r turns out to be: the network regime calibrates it
for `steps_max` steps (`network.calibration`), and a final run that takes fewer steps runs a
prefix of that schedule, which is a post-processing of the full one; the linear-probe regime's
full-batch runs have the same privacy loss for every T at a given single-release sigma
(`probe.privacy`). So the composition below (trials as recorded, final as planned) bounds the
whole adaptive procedure.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from dpadapter.privacy import Segment

# Value discretisation of the PLDs. Pessimistic discretisation keeps every epsilon an upper bound
# at any interval; 3e-4 matches 1e-4 (privacy.pld_epsilon's) to ~1e-4 relative on this
# project's histories at a quarter of the cost, which matters with dozens of runs per HPO.
DISCRETIZATION = 3e-4
TOL = 1e-9  # float slack when comparing a recomputed epsilon with its target


def _pld_module():
    from dp_accounting.pld import common, privacy_loss_distribution

    return privacy_loss_distribution, common


@functools.lru_cache(maxsize=512)
def _segment_pld(sigma: float, sample_rate: float, steps: int, discretization: float):
    """PLD of `steps` Poisson-subsampled Gaussian releases (cached: building one takes ~1 s).

    Full batch (q = 1, DP-GD) is no subsampling: each step is the Gaussian mechanism with
    l2-sensitivity 1 (in units of the clipping norm) and noise multiplier sigma under add/remove
    neighbours, and T such steps compose *exactly* to one Gaussian mechanism with noise
    multiplier sigma / sqrt(T) (mu = sqrt(T) / sigma in GDP; Dong, Roth & Su 2022, Cor. 3.3).
    That PLD is built directly: the same bound without T rounds of discretisation error, and the
    same PLD for every (sigma, T) with equal mu, which is what lets the linear-probe HPO pick T
    after a selection without changing the final run's privacy loss.
    """
    pld_mod, _ = _pld_module()
    if sample_rate == 1.0:
        return pld_mod.from_gaussian_mechanism(
            standard_deviation=sigma / math.sqrt(steps),
            value_discretization_interval=discretization,
        )
    return pld_mod.from_gaussian_mechanism(
        standard_deviation=sigma,
        sampling_prob=sample_rate,
        value_discretization_interval=discretization,
    ).self_compose(steps)


def history_pld(history: Iterable[Segment], discretization: float = DISCRETIZATION):
    """PLD of a run's recorded (or planned) releases; None if it made none."""
    out = None
    for s in history:
        if s.steps <= 0:
            continue
        if not s.noise_multiplier > 0:
            raise ValueError(f"a release without noise is not private: {s}")
        one = _segment_pld(
            float(s.noise_multiplier), float(s.sample_rate), int(s.steps), discretization
        )
        out = one if out is None else out.compose(one)
    return out


def release_pld(release: dict[str, Any], discretization: float = DISCRETIZATION):
    """PLD of one selection release as recorded by `SelectionMechanism.release`."""
    pld_mod, common = _pld_module()
    kind = release["mechanism"]
    if kind == "exponential":
        params = common.DifferentialPrivacyParameters(epsilon=float(release["pure_epsilon"]))
        return pld_mod.from_privacy_parameters(params, value_discretization_interval=discretization)
    if kind == "gaussian":
        return pld_mod.from_gaussian_mechanism(
            standard_deviation=float(release["noise_multiplier"]),
            value_discretization_interval=discretization,
        )
    if kind == "none":
        return None
    raise ValueError(f"unknown selection release {kind!r}")


def compose(plds: Iterable) -> Any:
    out = None
    for p in plds:
        if p is not None:
            out = p if out is None else out.compose(p)
    return out


def epsilon_of(pld, delta: float) -> float:
    return 0.0 if pld is None else float(pld.get_epsilon_for_delta(delta))


@dataclass(frozen=True)
class Composition:
    """Everything released: run histories and selection releases, and their epsilon at delta."""

    histories: tuple[tuple[Segment, ...], ...]
    releases: tuple[dict[str, Any], ...] = ()

    def pld(self, discretization: float = DISCRETIZATION):
        return compose(
            [
                *(history_pld(h, discretization) for h in self.histories),
                *(release_pld(r, discretization) for r in self.releases),
            ]
        )

    def epsilon(self, delta: float) -> float:
        return epsilon_of(self.pld(), delta)


def merge_segments(segments: Iterable[Segment]) -> list[Segment]:
    """Adjacent segments with the same (sigma, q) as one, as the ledger stores them."""
    out: list[Segment] = []
    for s in segments:
        if s.steps <= 0:
            continue
        if out and (out[-1].noise_multiplier, out[-1].sample_rate) == (
            s.noise_multiplier,
            s.sample_rate,
        ):
            out[-1] = Segment(s.noise_multiplier, s.sample_rate, out[-1].steps + s.steps)
        else:
            out.append(Segment(float(s.noise_multiplier), float(s.sample_rate), int(s.steps)))
    return out


def is_prefix(recorded: Sequence[Segment], planned: Sequence[Segment]) -> bool:
    """Whether `recorded` is the first releases of `planned` (equal counts as a prefix)."""
    expand_r = [(s.noise_multiplier, s.sample_rate) for s in recorded for _ in range(s.steps)]
    expand_p = [(s.noise_multiplier, s.sample_rate) for s in planned for _ in range(s.steps)]
    return len(expand_r) <= len(expand_p) and expand_r == expand_p[: len(expand_r)]


def history_of(rows: Iterable[dict]) -> tuple[Segment, ...]:
    """A history as written in the JSON outputs (`history_rows`), read back."""
    return tuple(Segment(**r) for r in rows)


def history_rows(history: Iterable[Segment]) -> list[dict]:
    """A history as the JSON outputs write it: one {noise_multiplier, sample_rate, steps} each."""
    return [
        dict(noise_multiplier=s.noise_multiplier, sample_rate=s.sample_rate, steps=s.steps)
        for s in history
    ]
