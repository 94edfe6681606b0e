"""Private selection mechanisms and the PLD composition of a whole HPO, against dp-accounting."""

import math

import dp_accounting
import numpy as np
import pytest

from dpadapter.hpo.accounting import Composition, is_prefix, merge_segments
from dpadapter.hpo.network.calibration import (
    BudgetError,
    calibrate_final_epsilon,
    final_epsilon_guess,
)
from dpadapter.hpo.selection import SelectionMechanism
from dpadapter.privacy import Segment

DELTA = 1e-5
TRIALS = (
    (Segment(6.0, 0.1, 12),),
    (Segment(4.0, 0.1, 20),),
    (Segment(3.0, 0.1, 15), Segment(2.5, 0.1, 5)),
)


def _independent_training_epsilon(histories, gaussian_releases=()):
    """dp-accounting's PLDAccountant over DpEvents built here from the raw numbers."""
    acc = dp_accounting.pld.PLDAccountant()
    for h in histories:
        for s in h:
            event = dp_accounting.PoissonSampledDpEvent(
                s.sample_rate, dp_accounting.GaussianDpEvent(s.noise_multiplier)
            )
            acc.compose(event, s.steps)
    for noise_std, n in gaussian_releases:
        # n counts, each of sensitivity 1: L2 sensitivity sqrt(n)
        acc.compose(dp_accounting.GaussianDpEvent(noise_std / math.sqrt(n)))
    return acc.get_epsilon(DELTA)


def test_exponential_mechanism_samples_proportionally_to_exp_eps_count():
    mech = SelectionMechanism("exponential", epsilon=math.log(3.0))
    rng = np.random.default_rng(0)
    picks = [mech.select([10, 11], rng)[0] for _ in range(4000)]
    assert np.mean(picks) == pytest.approx(0.75, abs=0.03)
    idx, published = mech.select([10, 500, 20], rng)
    assert idx == 1 and published == {}  # only the index is released
    assert mech.release(3) == {
        "mechanism": "exponential",
        "pure_epsilon": math.log(3.0),
        "candidates": 3,
    }


def test_gaussian_selection_releases_noisy_counts_at_the_stated_multiplier():
    mech = SelectionMechanism("gaussian", noise_std=20.0)
    rel = mech.release(4)
    assert rel["noise_multiplier"] == pytest.approx(10.0) and rel["l2_sensitivity"] == 2.0
    _, published = mech.select([1, 2, 3, 4], np.random.default_rng(0))
    assert len(published["noisy_counts"]) == 4


def test_unaccounted_selection_says_so():
    mech = SelectionMechanism("none")
    assert not mech.accounted
    assert "not claimed" in mech.release(3)["assumption"]
    with pytest.raises(ValueError):
        SelectionMechanism("argmax")


def test_composition_matches_an_independent_pld_accountant():
    mech = SelectionMechanism("gaussian", noise_std=30.0)
    comp = Composition(TRIALS, (mech.release(3), mech.release(3)))
    ours = comp.epsilon(DELTA)
    theirs = _independent_training_epsilon(TRIALS, [(30.0, 3), (30.0, 3)])
    assert ours == pytest.approx(theirs, rel=1e-3)
    # and every release counts: dropping a selection or a trial lowers the total
    assert Composition(TRIALS, (mech.release(3),)).epsilon(DELTA) < ours
    assert Composition(TRIALS[:2], comp.releases).epsilon(DELTA) < ours


def test_pure_dp_selection_is_charged_between_the_training_cost_and_basic_composition():
    mech = SelectionMechanism("exponential", epsilon=0.05)
    ours = Composition(TRIALS, (mech.release(3), mech.release(3))).epsilon(DELTA)
    training = _independent_training_epsilon(TRIALS)
    assert training < ours <= training + 2 * 0.05 + 1e-6


def test_final_budget_meets_the_target_tightly():
    q, steps, target = 0.1, 30, 1.0
    spent = Composition(TRIALS, (SelectionMechanism("exponential", epsilon=0.05).release(3),) * 2)

    def planned(e):  # any sigma decreasing in e will do; the real one calibrates (seconds)
        return [Segment(2.0 / e, q, steps)]

    guess = final_epsilon_guess(spent, DELTA, target, q, steps, "rdp")
    e_f, hist, total = calibrate_final_epsilon(spent, DELTA, target, planned, guess=guess)
    assert hist == planned(e_f)
    assert 0.99 * target <= total <= target
    recomputed = Composition((*TRIALS, tuple(hist)), spent.releases).epsilon(DELTA)
    assert recomputed == pytest.approx(total, rel=1e-9)
    # independent: the training part alone is below the total, training + selections bounds it
    training = _independent_training_epsilon((*TRIALS, tuple(hist)))
    assert training <= total <= training + 0.1 + 1e-6


def test_no_budget_left_is_an_error():
    spent = Composition(TRIALS)
    with pytest.raises(BudgetError, match="already spend"):
        calibrate_final_epsilon(spent, DELTA, 0.05, lambda e: [])


def test_prefix_and_merge():
    planned = [Segment(2.0, 0.1, 5), Segment(1.5, 0.1, 5)]
    assert is_prefix([Segment(2.0, 0.1, 5), Segment(1.5, 0.1, 2)], planned)
    assert is_prefix(planned, planned)
    assert not is_prefix([Segment(2.0, 0.1, 6)], planned)
    assert not is_prefix([*planned, Segment(1.5, 0.1, 1)], planned)
    assert merge_segments([Segment(2.0, 0.1, 2), Segment(2.0, 0.1, 3), Segment(1.0, 0.1, 0)]) == [
        Segment(2.0, 0.1, 5)
    ]
