"""The clipping-mode benchmark's own correctness gate runs in CI (timings there mean nothing).

`bench/cpu/dp_modes.py` refuses to report a ratio for a mode whose clipped sum differs from the
per-example loop; this runs that check for every mode on the embedded CNN (every registered model
is checked against the same kind of loop in tests/per_sample/test_bookkeeping.py), and shows that
a wrong clipped sum makes it fail.
"""

from __future__ import annotations

import json

import pytest
from bench_scripts import import_bench


@pytest.fixture(scope="module")
def dp_modes():
    return import_bench("dp_modes")


ARGS = ["--tiny", "--steps", "1", "--warmup", "0", "--settle", "1", "--threads", "1"]


def test_every_mode_passes_the_check_and_gets_a_ratio(dp_modes, tmp_path):
    assert dp_modes.main([*ARGS, "--models", "cnn-gn", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "dp_modes.json").read_text())
    assert [r["model"] for r in report["results"]] == ["cnn-gn"]
    for r in report["results"]:
        assert r["check"]["ok"]
        assert set(r["check"]["rel_error"]) == set(dp_modes.DEFAULT_MODES)
        assert max(r["check"]["rel_error"].values()) < 1e-9
        assert set(r["modes"]) == {"nonprivate", *dp_modes.DEFAULT_MODES}
        assert all(m["ratio"] > 0 for m in r["modes"].values())
    assert "| cnn-gn" in (tmp_path / "dp_modes.md").read_text()


def test_a_wrong_clipped_sum_fails_the_run(dp_modes, monkeypatch, capsys):
    real = dp_modes.Runner.clipped_sum

    def off_by_one_percent(self):
        got = real(self)
        return got * 1.01 if self.mode == "bk" else got

    monkeypatch.setattr(dp_modes.Runner, "clipped_sum", off_by_one_percent)
    assert dp_modes.main([*ARGS, "--models", "cnn-gn", "--modes", "ew", "bk"]) == 1
    assert "clipped-sum check FAILED for ['cnn-gn']" in capsys.readouterr().err
