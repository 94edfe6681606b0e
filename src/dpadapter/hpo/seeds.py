"""Seed streams of an HPO replicate, shared by both regimes so that one HPO seed draws the same
trial configurations and selection noise whichever regime trains them.

Every stream is derived from the HPO seed alone, never from data, so the privacy parameters of
every run are fixed before any private example is read.
"""

from __future__ import annotations

# numpy `default_rng([seed, STREAM, ...])` streams.
R_STREAM = 1  # each sweep's r and its (lr, T) decomposition
RANDOM_SEARCH_STREAM = 2  # the network regime's random-search baseline
SELECTION_STREAM = 3  # the selection mechanism's noise, one sub-stream per sweep


def trial_seed(seed: int, sweep: int, index: int) -> int:
    """Training seed of a trial: distinct from the final-budget runs' (which use `seed`)."""
    return 1000 * (seed + 1) + 100 * (sweep + 1) + index
