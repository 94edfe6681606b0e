from dpadapter.privacy.accounting import (
    PrivacyLedger,
    Segment,
    calibrate_sigma,
    epsilon_from_history,
    pld_epsilon,
)

__all__ = ["PrivacyLedger", "Segment", "calibrate_sigma", "epsilon_from_history", "pld_epsilon"]
