"""The self-test's record names each module's worst example, for the mode and the reference
(per_sample.margins, issue 66), and a refusal keeps that record."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from dpadapter.models import create_model
from dpadapter.per_sample import PerSampleCheckError, rules, wrap_for_dp
from dpadapter.per_sample.margins import worst_examples
from dpadapter.settings import ModelConfig

SAMPLE = ((1, 28, 28), torch.float32)


def _cnn() -> nn.Module:
    return create_model(ModelConfig("cnn-gn", 4, 8), 10, 1, seed=0)


@pytest.mark.parametrize("mode", ["bk", "hooks"])
def test_the_record_names_every_modules_worst_example(mode):
    rec = wrap_for_dp(_cnn(), mode, sample=SAMPLE).per_sample_check
    rows = rec["by_module"]
    trained = [m for m in _cnn().modules() if any(p.requires_grad for p in m.parameters(False))]
    assert len(rows) == len(trained)
    assert max(r["mode_error"] for r in rows.values()) == rec["norm_error"]
    for row in rows.values():
        assert 0 <= row["mode_example"] < rec["examples"]
        assert 0 <= row["reference_example"] < rec["examples"]
        assert 0 < row["reference_error"] < 1e-5 and 0 < row["norm"] <= row["whole_norm"]
        assert ("how" in row) is (mode == "bk")
    gn = [r for k, r in rows.items() if "(GroupNorm)" in k]
    assert gn and all(r["how"].startswith("per-example") for r in gn if mode == "bk")


def test_a_refusal_keeps_its_record_naming_the_wrong_example(monkeypatch):
    """One example's GroupNorm weight gradient 50 % too large: refused (a planted bug still
    fails), and the record on the error names that example and says the reference is right
    there (the mode's kernel, not the device's arithmetic)."""
    right = rules.group_norm_folded

    def wrong(*args):
        dx, gw, gb = right(*args)
        gw = gw.clone()
        gw[3] *= 1.5
        return dx, gw, gb

    monkeypatch.setattr(rules, "group_norm_folded", wrong)
    with pytest.raises(PerSampleCheckError, match=r"\(GroupNorm\)") as e:
        wrap_for_dp(_cnn(), "bk", sample=SAMPLE)
    rec = e.value.record
    assert rec is not None and rec["passed"] is False
    worst = max(rec["by_module"].items(), key=lambda kv: kv[1]["mode_error"])
    assert "(GroupNorm)" in worst[0]
    row = worst[1]
    assert row["mode_example"] == 3 and row["mode_error"] > 0.05
    assert row["reference_error_at_mode_example"] < 1e-5


def test_worst_examples_counts_nan_as_worst_and_works_without_a_working_reference():
    ref = {"a": torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)}
    measured = {"a": torch.tensor([1e-7, float("nan"), 1e-3], dtype=torch.float64)}
    (row,) = worst_examples(ref, {}, measured, 1e-5).values()
    assert row["mode_example"] == 1 and math.isnan(row["mode_error"])
    assert "reference_error" not in row and row["norm"] == 2.0
    working = {"a": torch.tensor([1.0, 2.0, 3.0 * (1 + 1e-6)], dtype=torch.float64)}
    (row,) = worst_examples(ref, working, measured, 1e-5, {"a": "ghost"}).values()
    assert row["reference_example"] == 2 and row["reference_error"] == pytest.approx(1e-6)
    assert row["how"] == "ghost"
