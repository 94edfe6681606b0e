"""Every sigma set from a target epsilon comes from one search: `privacy.calibration`.

Each call site (constant sigma, AdpAlloc's decay, the federated joint sigma, the HPO's single-
release, final and guess sigmas) is spied on to show it goes through `smallest_sigma`, and what
it returns is checked against the target with the accountant it searched with. The search
itself is checked on functions whose answer is known in closed form.
"""

from __future__ import annotations

import math

import pytest

import dpadapter.privacy.calibration as cal
from dpadapter.privacy import CalibrationError, Search, Segment, epsilon_from_history

DELTA = 1e-5


def _constant():
    s = cal.calibrate_sigma(2.0, DELTA, 0.1, 40, "rdp")
    return s, epsilon_from_history([Segment(s, 0.1, 40)], DELTA, "rdp"), 2.0


def _decay():
    from dpadapter.algorithms.adpalloc import calibrate_decay, planned_history

    c = cal.calibrate_sigma(2.0, DELTA, 0.1, 40, "rdp")
    s0 = calibrate_decay(2.0, DELTA, 0.1, 10, 4, 0.2, "rdp", c)
    return s0, epsilon_from_history(planned_history(s0, 0.2, 0.1, 10, 4), DELTA, "rdp"), 2.0


def _joint():
    from dpadapter.federated.mechanisms import gaussian_sigma

    prior = [Segment(40.0, 1.0, 2)]
    s = gaussian_sigma(2.0, DELTA, 0.1, 40, "rdp", prior)
    return s, epsilon_from_history([*prior, Segment(s, 0.1, 40)], DELTA, "rdp"), 2.0


def _single():
    from dpadapter.hpo.accounting import epsilon_of, history_pld
    from dpadapter.hpo.probe.privacy import single_release_sigma

    single_release_sigma.cache_clear()
    s = single_release_sigma(0.5, DELTA)
    return s, epsilon_of(history_pld([Segment(s, 1.0, 1)]), DELTA), 0.5


def _final():
    from dpadapter.hpo.accounting import Composition, compose, epsilon_of, history_pld
    from dpadapter.hpo.probe.privacy import final_sigma

    spent = Composition(histories=((Segment(20.0, 1.0, 4),),))
    s = final_sigma(spent, DELTA, 2.0)
    total = compose([spent.pld(), history_pld([Segment(s, 1.0, 1)])])
    return s, epsilon_of(total, DELTA), 2.0


CALL_SITES = {
    "constant": _constant,
    "adpalloc-decay": _decay,
    "federated-joint": _joint,
    "hpo-single-release": _single,
    "hpo-final": _final,
}


@pytest.mark.parametrize("site", sorted(CALL_SITES))
def test_every_call_site_goes_through_the_one_search_and_meets_its_target(site, monkeypatch):
    calls = []
    real = cal._search

    def spy(*args, **kwargs):
        calls.append(args[2])
        return real(*args, **kwargs)

    monkeypatch.setattr(cal, "_search", spy)
    sigma, spent, target = CALL_SITES[site]()
    assert calls, f"{site} calibrated without privacy.calibration.smallest_sigma"
    assert all(isinstance(s, Search) for s in calls)
    assert 0 < spent <= target
    assert spent > 0.9 * target, "the search stopped far from the target (wasted budget)"
    assert sigma > 0


def test_the_hpo_guess_goes_through_the_one_search(monkeypatch):
    from dpadapter.hpo.accounting import Composition
    from dpadapter.hpo.network.calibration import final_epsilon_guess

    calls = []
    real = cal._search
    monkeypatch.setattr(cal, "_search", lambda *a, **k: calls.append(a[2]) or real(*a, **k))
    spent = Composition(histories=((Segment(20.0, 1.0, 4),),))
    e = final_epsilon_guess(spent, DELTA, 2.0, 0.1, 40, "rdp")
    assert calls and 0 < e


# --- the search on closed-form functions: eps(sigma) = 10 / sigma, so the answer is 10 / target
def _eps(sigma: float) -> float:
    return 10.0 / sigma


@pytest.mark.parametrize(
    "search",
    [
        cal.OPACUS,
        Search(start=1.0, cap=1e8, shrink_to=1e-4, midpoint="geometric", ratio=1.001),
        Search(start=1.0, grow=1.05, low=0.5, low_follows=True, rel_width=0.005),
        Search(start=40.0, grow=1.1, low=1.0, low_follows=True, try_low=True,
               midpoint="illinois", rel_width=1e-3, log_tol=math.log1p(0.005 / 2.0)),
    ],
    ids=["opacus", "geometric", "joint", "illinois"],
)  # fmt: skip
@pytest.mark.parametrize("target", [0.5, 2.0, 7.0])
def test_the_search_returns_a_feasible_sigma_close_to_the_smallest(search, target):
    sigma = cal.smallest_sigma(_eps, target, search)
    assert _eps(sigma) <= target
    assert sigma <= (10.0 / target) * 1.01 + 1e-12


def test_the_search_refuses_beyond_its_cap_and_its_time():
    with pytest.raises(CalibrationError, match="needs sigma > 100"):
        cal.smallest_sigma(_eps, 0.01, Search(start=1.0, cap=100.0, eps_tol=0.005))
    with pytest.raises(CalibrationError, match="did not converge in"):
        cal.smallest_sigma(_eps, 2.0, cal.OPACUS, max_seconds=-1.0)


def test_results_are_cached_under_their_key(tmp_path):
    cache = tmp_path / "sigma.json"
    a = cal.smallest_sigma(_eps, 2.0, cal.OPACUS, cache=cache, key="k")
    b = cal.smallest_sigma(lambda s: math.nan, 2.0, cal.OPACUS, cache=cache, key="k")
    assert a == b  # the second search never ran: its function cannot be calibrated
