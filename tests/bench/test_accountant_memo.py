"""bench/cpu/accountant_memo.py: it times the three variants and refuses when one gives another
number (a memo that returned a neighbour's value would be caught there too)."""

from __future__ import annotations

import sys

import pytest
from bench_scripts import import_bench
from opacus.accountants.analysis import rdp as analysis

# runs the benchmark script (times calibrations three ways): too long for `make check`
pytestmark = pytest.mark.slow

ARGS = ["--repeats", "1", "--epochs", "2", "--steps-per-epoch", "3", "--epsilons", "4"]


def test_prints_each_variant_and_checks_they_agree(monkeypatch, capsys):
    bench = import_bench("accountant_memo")
    monkeypatch.setattr(sys, "argv", ["accountant_memo.py", *ARGS])
    bench.main()
    out = capsys.readouterr().out
    rows = [ln for ln in out.splitlines() if ln.startswith("| ") and "variant" not in ln]
    assert [r.split(" | ")[0] for r in rows] == ["| opacus", "| memo, cold", "| memo, warm"]
    assert rows[0].endswith("| 1.00 |") and "identical in all three" in out
    assert getattr(analysis._compute_rdp, "cache_info", None)  # the memo is back in place


def test_a_memo_giving_another_value_stops_it(monkeypatch):
    bench = import_bench("accountant_memo")
    monkeypatch.setattr(sys, "argv", ["accountant_memo.py", *ARGS])
    # the memo installed, as the script installs it (one small job's accounting, not a run of
    # the script: the run below is the one under test)
    bench.epsilon_from_history([bench.Segment(1.0, 0.1, 1)], 1e-5, "prv")
    memo = analysis._compute_rdp
    assert getattr(memo, "cache_info", None)

    class Off:  # a memo whose values are a little off
        __wrapped__ = staticmethod(memo.__wrapped__)

        def __call__(self, q, sigma, alpha):
            return memo(q, sigma, alpha) * 1.001

        def cache_clear(self):
            pass

    monkeypatch.setattr(analysis, "_compute_rdp", Off())
    monkeypatch.setattr(bench.rdp_memo, "install", lambda module: True)
    with pytest.raises(SystemExit, match="Opacus alone"):
        bench.main()
