"""The sigma calibration is bounded in range and time; an unreachable epsilon fails clearly.

Before, epsilon = 1000 did not finish in 90 s and epsilon = 100000 searched for 66 minutes
(Opacus' search has no lower bound on sigma and an absolute tolerance).
"""

import time

import pytest
from opacus.accountants.utils import get_noise_multiplier

from dpadapter.privacy import CalibrationError, calibrate_sigma, max_reachable_epsilon
from dpadapter.privacy.calibration import SIGMA_MIN, _calibrate


@pytest.mark.parametrize("eps", [1000.0, 100000.0])
def test_huge_epsilon_fails_fast_naming_the_target(eps):
    t0 = time.monotonic()
    with pytest.raises(CalibrationError, match=f"target epsilon {eps:g} .* Use an epsilon below"):
        calibrate_sigma(eps, 1e-5, 0.1, 60)
    assert time.monotonic() - t0 < 60


@pytest.mark.parametrize(("eps", "accountant"), [(1.0, "rdp"), (4.0, "rdp"), (2.0, "prv")])
def test_reachable_targets_get_opacus_sigma_unchanged(eps, accountant):
    kwargs = {"eps_error": 0.01} if accountant == "prv" else {}
    want = get_noise_multiplier(
        target_epsilon=eps,
        target_delta=1e-5,
        sample_rate=0.1,
        steps=60,
        accountant=accountant,
        epsilon_tolerance=0.005,
        **kwargs,
    )
    assert _calibrate(eps, 1e-5, 0.1, 60, accountant) == want


def test_time_bound_and_tiny_budget_fail_clearly():
    with pytest.raises(CalibrationError, match="did not converge in"):
        _calibrate(4.0, 1e-5, 0.1, 60, "rdp", max_seconds=-1.0)
    with pytest.raises(CalibrationError, match="needs sigma >"):
        _calibrate(1e-6, 1e-5, 1.0, 1000, "rdp")


def test_validation_bound_is_above_what_calibration_reaches():
    top = max_reachable_epsilon(1e-5, 0.1, 60)
    sigma = calibrate_sigma(0.9 * top, 1e-5, 0.1, 60, "rdp")
    assert sigma >= SIGMA_MIN
    with pytest.raises(CalibrationError):
        calibrate_sigma(1.01 * top, 1e-5, 0.1, 60, "rdp")
