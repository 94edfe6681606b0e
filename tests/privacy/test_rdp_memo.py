"""The memo of Opacus' per-order RDP (privacy/rdp_memo.py): the same epsilon, bit for bit, as
Opacus' own accountants computing every value, and each value computed once per process."""

from __future__ import annotations

import types

import pytest
from opacus.accountants import create_accountant
from opacus.accountants.analysis import rdp as analysis

from dpadapter.privacy import rdp_memo
from dpadapter.privacy.accounting import EPS_ERROR, Segment, _epsilon, rdp_epsilon

HISTORIES = [
    [Segment(1.1, 0.1, 60)],
    [Segment(0.8, 0.02, 500), Segment(1.3, 0.02, 100)],  # two sigmas: a heterogeneous PRV
    [Segment(2.0, 0.5, 10), Segment(2.0, 0.25, 7)],  # two rates
    [Segment(5.0, 1.0, 3)],  # q = 1: Opacus' closed form
]


def _opacus_alone(history, delta, accountant):
    """Opacus computing every RDP value: its own `_compute_rdp`, not the memo."""
    with rdp_memo.bypassed(analysis):
        acc = create_accountant(accountant)
        acc.history = [s.as_tuple() for s in history]
        kw = {"eps_error": EPS_ERROR} if accountant == "prv" else {}
        return float(acc.get_epsilon(delta=delta, **kw))


@pytest.mark.parametrize("accountant", ["prv", "rdp"])
@pytest.mark.parametrize("history", HISTORIES, ids=range(len(HISTORIES)))
def test_epsilon_through_the_memo_is_opacus_own_bit_for_bit(history, accountant):
    want = _opacus_alone(history, 1e-5, accountant)
    first = _epsilon(history, 1e-5, accountant)  # installs the memo, fills it
    again = _epsilon(history, 1e-5, accountant)  # from the memo
    assert first == again == want
    if accountant == "rdp":
        assert rdp_epsilon(history, 1e-5) == want


def test_a_repeated_epsilon_computes_no_rdp_value_again():
    history = [Segment(0.93, 0.07, 140)]
    _epsilon(history, 1e-5, "prv")
    before = rdp_memo.info(analysis)
    assert before is not None and before.currsize > 0
    _epsilon(history, 1e-5, "prv")
    after = rdp_memo.info(analysis)
    assert after.misses == before.misses and after.hits > before.hits
    # another sigma is another key: computed, not taken from a neighbour
    _epsilon([Segment(0.94, 0.07, 140)], 1e-5, "prv")
    assert rdp_memo.info(analysis).misses > after.misses


def test_keys_keep_the_types_apart_and_install_is_idempotent():
    fake = types.ModuleType("fake_rdp")
    calls = []

    def _compute_rdp(q, sigma, alpha):
        calls.append((q, sigma, alpha))
        return q * alpha / sigma

    fake._compute_rdp = _compute_rdp
    assert rdp_memo.install(fake) and rdp_memo.install(fake)
    assert fake._compute_rdp.__wrapped__ is _compute_rdp  # wrapped once
    assert fake._compute_rdp(0.1, 2.0, 3) == fake._compute_rdp(0.1, 2.0, 3)
    fake._compute_rdp(0.1, 2.0, 3.0)  # an int and a float order are two keys
    fake._compute_rdp(0.1, 2.5, 3)
    assert calls == [(0.1, 2.0, 3), (0.1, 2.0, 3.0), (0.1, 2.5, 3)]


def test_an_opacus_without_the_function_is_left_alone():
    other = types.ModuleType("other_rdp")
    assert rdp_memo.install(other) is False
    assert not hasattr(other, "_compute_rdp") and rdp_memo.info(other) is None


def test_bypassed_computes_every_value_and_puts_the_memo_back():
    history = [Segment(0.71, 0.05, 30)]
    _epsilon(history, 1e-5, "prv")
    memo = analysis._compute_rdp
    before = rdp_memo.info(analysis)
    with rdp_memo.bypassed(analysis):
        assert rdp_memo.info(analysis) is None and not rdp_memo.install(analysis)
        _epsilon(history, 1e-5, "prv")  # through `_accountant`, which installs: refused inside
        assert rdp_memo.info(analysis) is None
    assert analysis._compute_rdp is memo and rdp_memo.info(analysis) == before
