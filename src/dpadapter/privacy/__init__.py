"""Privacy accounting, noise calibration and the ledger of releases; no training code."""

from dpadapter.privacy.accounting import (
    PrivacyLedger,
    Segment,
    epsilon_from_history,
    pld_epsilon,
)
from dpadapter.privacy.calibration import (
    CalibrationError,
    Search,
    calibrate_sigma,
    max_reachable_epsilon,
    smallest_sigma,
    verify_plan,
)

__all__ = [
    "CalibrationError",
    "PrivacyLedger",
    "Search",
    "Segment",
    "calibrate_sigma",
    "epsilon_from_history",
    "max_reachable_epsilon",
    "pld_epsilon",
    "smallest_sigma",
    "verify_plan",
]
