"""The process memo of constant-sigma calibrations (`memo.sealed`, gated by `privacy.genuine`):
a repeat computes nothing, and while anything on the accountant's path is replaced (a stub, a
spy, a value-changing wrapper), the memo is neither written nor read: the suite's tests share
it, and one test's stub must never become another test's sigma."""

from __future__ import annotations

import functools
import itertools
import json

import pytest
from opacus.accountants import RDPAccountant
from opacus.accountants.analysis import rdp as analysis

from dpadapter.privacy import accounting, calibration, memo, rdp_memo
from dpadapter.privacy.calibration import _calibrate, calibrate_sigma

# inputs no other test calibrates (the memo is the worker's), each call's its own: another
# sample rate, so no two searches evaluate Opacus' per-order RDP at the same (q, sigma, order)
_calls = itertools.count()


def _inputs() -> tuple[float, float, float, int, str]:
    n = next(_calls)
    return (3.0 + n / 97, 1e-5, 0.1 + n / 1009, 40 + n, "rdp")


def _rdp_values_computed() -> int:
    info = rdp_memo.info(analysis)
    return info.misses + info.hits


def test_a_repeat_is_answered_from_memory_with_the_accountant_own_value():
    args = _inputs()
    want = _calibrate(*args)  # the search itself, memo or not
    assert calibrate_sigma(*args) == want
    before = _rdp_values_computed()
    assert calibrate_sigma(*args) == want
    assert _rdp_values_computed() == before  # no epsilon was evaluated for the repeat
    assert calibration.accountant_is_genuine()


def test_another_results_folder_takes_the_value_from_memory(tmp_path):
    """The suite's stage tests each calibrate into a results folder of their own."""
    args = _inputs()
    first = calibrate_sigma(*args, cache=tmp_path / "a" / "sigma.json")
    before = _rdp_values_computed()
    assert calibrate_sigma(*args, cache=tmp_path / "b" / "sigma.json") == first
    assert _rdp_values_computed() == before
    assert (tmp_path / "b" / "sigma.json").is_file()  # written for the folder's other jobs


def _off(value: float) -> float:
    return value * 1.001 + 0.01


class _OffObject:  # a callable stand-in for Opacus' per-order RDP
    def __init__(self, real):
        self.real = real

    def __call__(self, q, sigma, alpha):
        return _off(self.real(q, sigma, alpha))


def _wraps_off(real):
    @functools.wraps(real)  # looks like the original by name, module and __wrapped__
    def off(*args, **kwargs):
        return _off(real(*args, **kwargs))

    return off


# (module or class, name, replacement built from the original)
PATCHES = {
    "calibration._calibrate": (calibration, "_calibrate", lambda real: lambda *a, **k: 2.5),
    "calibration._search (spy)": (calibration, "_search", _wraps_off),
    "calibration.epsilon_from_history": (calibration, "epsilon_from_history", _wraps_off),
    "accounting._epsilon": (accounting, "_epsilon", _wraps_off),
    # a rebinding only, to a function computing the same values
    "accounting._accountant": (accounting, "_accountant", lambda real: lambda n: real(n)),
    "opacus _compute_rdp (object)": (analysis, "_compute_rdp", _OffObject),
    "opacus _compute_rdp (functools.wraps)": (analysis, "_compute_rdp", _wraps_off),
    "opacus RDPAccountant.get_epsilon": (RDPAccountant, "get_epsilon", _wraps_off),
}


@pytest.mark.slow  # over ~1.5 s: make check's 2 minutes (docs/testing.md)
@pytest.mark.parametrize("where", sorted(PATCHES))
def test_a_replaced_accountant_neither_writes_nor_reads_the_memo(where, monkeypatch, tmp_path):
    owner, name, replace = PATCHES[where]
    rdp_memo.install(analysis)  # the per-order memo in place, as after any accounting
    per_order = analysis._compute_rdp  # counts every epsilon evaluation, replaced or not

    def evaluations() -> int:
        info = per_order.cache_info()
        return info.hits + info.misses

    known, fresh = _inputs(), _inputs()
    remembered = calibrate_sigma(*known)  # a genuine entry
    assert is_remembered(known)
    monkeypatch.setattr(owner, name, replace(getattr(owner, name)))
    assert not calibration.accountant_is_genuine(), where

    calibrate_sigma(*fresh)  # computed through the replacement: not written
    calibrate_sigma(*fresh, cache=tmp_path / "sigma.json")  # nor through a results folder's file
    assert not is_remembered(fresh)
    # not read either: the remembered inputs are computed again, through the replacement
    before = evaluations()
    again = calibrate_sigma(*known)
    if name == "_calibrate":
        assert again == 2.5
    else:
        assert evaluations() > before, "a replaced accountant was answered from the memo"
        if name != "_accountant":  # the others change the values
            assert again != remembered

    monkeypatch.undo()
    assert calibration.accountant_is_genuine()
    assert calibrate_sigma(*fresh) == _calibrate(*fresh)  # the real value, now remembered
    assert is_remembered(fresh) and calibrate_sigma(*known) == remembered


def is_remembered(args: tuple) -> bool:
    return any(_args_match(k, args) for k in memo._SEALED)


def _args_match(key: str, args: tuple) -> bool:
    target, delta, q, steps, accountant = args
    k = json.loads(key)
    return k[3:7] == [target, delta, q, steps] and k[7] == accountant


def test_clear_memory_forgets_the_process_memo_too():
    args = _inputs()
    calibrate_sigma(*args)
    assert is_remembered(args)
    memo.clear_memory()
    assert not is_remembered(args)
