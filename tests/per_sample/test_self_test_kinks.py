"""The self-test's second look at a few examples off by a kink (self_test docstring: kinks).

A kink cannot be placed on purpose in a real model's batched float32 forward, so the mode is
made wrong at one example by hand: only on its first look (a kink, gone once the input moves),
on every look (a bug on one example), or at most examples (a wrong mode)."""

from __future__ import annotations

import pytest
import torch

from dpadapter.models import create_model
from dpadapter.per_sample import PerSampleCheckError, self_test, wrap_for_dp
from dpadapter.per_sample import bookkeeping as bk_module
from dpadapter.settings import ModelConfig

SAMPLE = ((1, 28, 28), torch.float32)


def _off_at(monkeypatch, rows: list[int], looks: int | None) -> list[int]:
    """bk's norms 2% high at `rows` on the first `looks` forward passes (None: always), at the
    physical size (`self_test.EXAMPLES`) only: the check at the small size is not the subject."""
    calls = [0]
    original = bk_module.BookKeepingModule.per_sample_norms

    def norms(self, params):
        out = original(self, params)
        physical = out.shape[0] == self_test.EXAMPLES
        if physical and (looks is None or calls[0] < 2 * looks):  # two runs a look: got, moved
            out = out.clone()
            out[rows] *= 1.02
        return out

    def forward(self, *a, **k):
        if a and a[0].shape[0] == self_test.EXAMPLES:
            calls[0] += 1
        return original_forward(self, *a, **k)

    original_forward = bk_module.BookKeepingModule.forward
    monkeypatch.setattr(bk_module.BookKeepingModule, "per_sample_norms", norms)
    monkeypatch.setattr(bk_module.BookKeepingModule, "forward", forward)
    return calls


def _model():
    return create_model(ModelConfig("cnn-gn", 4, 8), 10, 1, seed=0)


def test_one_example_off_once_is_moved_and_passes(monkeypatch):
    calls = _off_at(monkeypatch, [3], looks=1)
    got = wrap_for_dp(_model(), "bk", sample=SAMPLE)
    rec = got.per_sample_check
    assert rec["passed"] is True and rec["redrawn_near_kinks"] == 1
    assert calls[0] == 4  # looked twice


def test_one_example_off_every_time_is_refused(monkeypatch):
    _off_at(monkeypatch, [3], looks=None)
    with pytest.raises(PerSampleCheckError, match="also after moving 1 example"):
        wrap_for_dp(_model(), "bk", sample=SAMPLE)


def test_many_examples_off_are_refused_without_a_second_look(monkeypatch):
    calls = _off_at(monkeypatch, [0, 1, 2, 5, 6], looks=1)
    with pytest.raises(PerSampleCheckError) as e:
        wrap_for_dp(_model(), "bk", sample=SAMPLE, check_batch=self_test.EXAMPLES)
    assert "also after moving" not in str(e.value)
    assert calls[0] == 2  # one look only


def test_a_right_mode_needs_no_second_look():
    got = wrap_for_dp(_model(), "bk", sample=SAMPLE)
    assert got.per_sample_check["redrawn_near_kinks"] == 0
