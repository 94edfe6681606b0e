"""AdpAlloc (Yu et al. 2019), exponential decay: sigma_t = sigma_0 * exp(-k t), t the epoch.

The run's history is heterogeneous (one segment per epoch), so sigma_0 is calibrated on that
planned history with the run's own accountant rather than from a constant-sigma formula. The
ledger then records the sigma each step actually used; it equals the plan unless the run stops
early, in which case it is a prefix of it (and spends less).
"""

from __future__ import annotations

import json
import math
from typing import Any

from dpadapter.algorithms.base import DPAlgorithm, register_algorithm
from dpadapter.ground.param_schema import NON_NEGATIVE, params_object
from dpadapter.privacy import Search, Segment, epsilon_from_history, smallest_sigma
from dpadapter.privacy.accounting import EPS_ERROR, accountant_version
from dpadapter.privacy.calibration import KEY_VERSION
from dpadapter.privacy.memo import cached

REL_TOL = 1e-3  # stop when the bracket on sigma_0 is this narrow (relative) ...
EPS_TOL = 0.005  # ... or the feasible end spends within this of the target (Opacus' default)


def decayed(sigma0: float, decay: float, epoch: int) -> float:
    return sigma0 * math.exp(-decay * epoch)


def planned_history(
    sigma0: float, decay: float, q: float, steps_per_epoch: int, epochs: int
) -> list[Segment]:
    return [Segment(decayed(sigma0, decay, e), q, steps_per_epoch) for e in range(epochs)]


def calibrate_decay(
    target_epsilon: float,
    delta: float,
    q: float,
    steps_per_epoch: int,
    epochs: int,
    decay: float,
    accountant: str,
    constant_sigma: float,
) -> float:
    """Smallest sigma_0 (to the tolerances) whose planned history spends at most the target.

    Bracket without extra accountant calls: sigma_0 = constant_sigma (the constant schedule's
    calibrated sigma) puts every epoch at or below it, so it spends at least as much as the
    constant schedule; sigma_0 = constant_sigma * exp(k (E - 1)) puts every epoch at or above it
    and so spends at most the target (a subsampled Gaussian's epsilon falls as sigma grows).
    Opacus' accountants cost seconds per heterogeneous history (PRV grows faster than linearly
    in the number of segments), so the root is found by the Illinois variant of regula falsi on
    log epsilon against log sigma_0, which needs far fewer evaluations than plain bisection.
    Hand-written: Opacus only calibrates constant schedules. The returned end is always one
    whose planned history was evaluated as spending at most the target.
    """

    def epsilon(s0: float) -> float:
        hist = planned_history(s0, decay, q, steps_per_epoch, epochs)
        return epsilon_from_history(hist, delta, accountant)

    search = Search(
        start=constant_sigma * math.exp(decay * max(0, epochs - 1)),
        grow=1.1,  # numerical slack of the accountant; the bracket argument says this is rare
        low=constant_sigma,
        low_follows=True,
        try_low=True,
        midpoint="illinois",
        rel_width=REL_TOL,
        log_tol=math.log1p(EPS_TOL / target_epsilon),
    )
    return smallest_sigma(epsilon, target_epsilon, search)


@register_algorithm("adpalloc")
class AdpAlloc(DPAlgorithm):
    """DP-SGD whose noise multiplier decays by epoch; `sigma` is sigma_0.

    `decay` is k per epoch (the DPAdapter paper does not state it; tune it in
    finetune.algo_params.adpalloc). Calibration is cached next to the constant-sigma cache.
    """

    params_schema = params_object(decay=NON_NEGATIVE)

    @classmethod
    def default_params(cls) -> dict[str, Any]:
        return {"decay": 0.01}

    def calibrate(self) -> float:
        s, k = self.spec, float(self.params["decay"])
        if k < 0:
            raise ValueError(f"adpalloc: decay must be >= 0, got {k}")
        inputs = (
            s.target_epsilon,
            s.delta,
            s.sample_rate,
            s.steps_per_epoch,
            s.epochs,
            k,
            s.accountant,
        )
        key = json.dumps(
            ["adpalloc-exp", KEY_VERSION, accountant_version(), *inputs, EPS_ERROR, REL_TOL]
            + [EPS_TOL]
        )
        # the constant-sigma calibration of the base class brackets sigma_0 from below
        constant = lambda: super(AdpAlloc, self).calibrate()  # noqa: E731
        return cached(s.calibration_cache, key, lambda: calibrate_decay(*inputs, constant()))

    def noise_multiplier(self, epoch: int) -> float:
        return decayed(self.sigma, float(self.params["decay"]), epoch)

    def planned_history(self) -> list[Segment]:
        s = self.spec
        return planned_history(
            self.sigma, float(self.params["decay"]), s.sample_rate, s.steps_per_epoch, s.epochs
        )
