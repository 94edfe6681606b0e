"""hpo.csv / hpo.md from hand-written metrics: columns, RERR, and labels of unaccounted tuning."""

import csv
import json
import math

import pytest

from dpadapter.hpo.network import summary


def _final(path, acc, total, accounted=True):
    hpo = {"total_epsilon": total, "target_epsilon": 1.0, "selection": "exponential",
           "selection_accounted": accounted}  # fmt: skip
    if not accounted:
        hpo["selection"], hpo["privacy_assumption"] = "none", "validation privacy not claimed"
    w = {"upstream": "standard", "task": "t", "algo": "dpsgd", "seed": "0"}
    path.write_text(json.dumps({"wildcards": w, "test_accuracy": acc, "hpo": hpo}))
    return path


def _oracle(path, acc):
    m = {"upstream": "standard", "task": "t", "algorithm": "dpsgd", "test_accuracy": acc,
         "total_epsilon": 3.5, "target_epsilon": 1.0, "seed": 0}  # fmt: skip
    path.write_text(json.dumps(m))
    return path


def test_rerr():
    assert summary.rerr(0.8, 0.5, 0.9) == pytest.approx(0.75)
    assert math.isnan(summary.rerr(0.8, 0.5, 0.5))


def test_csv_columns_and_table3(tmp_path):
    lin = _final(tmp_path / "lin.json", 0.8, 0.99)
    rnd = _final(tmp_path / "rnd.json", 0.5, 0.98)
    orc = _oracle(tmp_path / "orc.json", 0.9)
    rows = summary.run([lin], [rnd], [orc], tmp_path / "hpo.csv", tmp_path / "hpo.md")
    assert [r["method"] for r in rows] == ["random_search", "grid_oracle", "linear_scaling"]
    got = list(csv.DictReader(open(tmp_path / "hpo.csv")))
    assert list(got[0])[:4] == ["method", "accuracy", "total_epsilon", "target_epsilon"]
    md = (tmp_path / "hpo.md").read_text()
    # one HPO seed each: every accuracy is marked as n = 1 (no spread), RERR of the means
    assert "| standard | t | dpsgd | 50.0 (n=1)† | 90.0 (n=1)† | 80.0 (n=1)† | 75.0 |" in md
    assert "How to read this" in md
    assert "Grid oracle (HPO cost not incl.)" in md


def test_unaccounted_selection_is_labelled(tmp_path):
    lin = _final(tmp_path / "lin.json", 0.8, 0.99, accounted=False)
    rows = summary.run([lin], [], [], tmp_path / "hpo.csv", tmp_path / "hpo.md")
    assert rows[0]["tuning_accounted"] is False and "not claimed" in rows[0]["note"]
    assert "not claimed" in (tmp_path / "hpo.md").read_text()
