"""Privacy accounting, noise calibration and the ledger of releases; no training code.

Layer 1: every mechanism's ε comes from here, so it may import only the ground floor
(`ground`, `settings`), never models, data or a training loop (tests/test_import_layers.py).
"""

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
