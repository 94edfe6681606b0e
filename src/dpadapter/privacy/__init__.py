from dpadapter.privacy.accounting import (
    CalibrationError,
    PrivacyLedger,
    Segment,
    calibrate_sigma,
    epsilon_from_history,
    max_reachable_epsilon,
    pld_epsilon,
)

__all__ = [
    "CalibrationError",
    "PrivacyLedger",
    "Segment",
    "calibrate_sigma",
    "epsilon_from_history",
    "max_reachable_epsilon",
    "pld_epsilon",
]
