"""Book-keeping clipping (`grad_sample_mode: bk`) under every registered algorithm.

The algorithms' phases run on top of the optimizer's clipped sum; bk replaces only how that sum
(and the per-example norms: AdpClip's count) is computed. So each algorithm in bk mode must make
the releases Opacus' hooks mode makes, query by query, to float tolerance: DP-SAM's ascent and
descent, GEP's embedding and residual (GEP reads per-example gradients and runs hooks under bk),
AdpClip's gradient and clipped count, with virtual batches, momentum, an empty Poisson batch, and
the trained parameters changing between steps (head only, all, head only: the HT/UT strategies).
"""

from __future__ import annotations

import algo_harness as H
import pytest
import torch
from privacy_checks import _double, _xy

from dpadapter.algorithms import ALGORITHMS
from dpadapter.per_sample.bookkeeping import BookKeepingModule

NAMES = sorted(ALGORITHMS)


def _run(name: str, mode: str, data, phases: tuple[str, ...] = ("ft", "ft", "ft")) -> H.Run:
    s = H.spec(max_grad_norm=0.5, expected_batch_size=12)
    run = H.build(
        name,
        s,
        public=_double(data.public),
        sigma=0.7,
        lr=0.5,
        momentum=0.5,
        mode=mode,
        dtype=torch.float64,
    )
    head = {id(p) for p in run.model.get_classifier().parameters()}
    for t, phase in enumerate(phases):  # HT/UT strategies change what is trained between steps
        for p in run.model.parameters():
            p.requires_grad_(phase == "ft" or id(p) in head)
        x, y = _xy(data, 12 * t, 12)
        H.logical_step(run, x.double(), y, physical=5)
        if t == 1:
            H.empty_step(run)
    return run


@pytest.mark.parametrize("phases", [("ft", "ft", "ft"), ("ht", "ft", "ht")])
@pytest.mark.parametrize("name", NAMES)
def test_bk_makes_the_releases_of_opacus_hooks(name, algo_data, phases):
    hooks, bk = _run(name, "hooks", algo_data, phases), _run(name, "bk", algo_data, phases)
    uses_bk = not ALGORITHMS[name].needs_per_sample_gradients
    assert isinstance(bk.gsm, BookKeepingModule) == uses_bk
    assert len(hooks.algo.audit) == len(bk.algo.audit) == 4
    for step, (a, b) in enumerate(zip(hooks.algo.audit, bk.algo.audit, strict=True)):
        assert a.recorded_noise_multiplier == b.recorded_noise_multiplier
        assert [r.name for r in a.releases] == [r.name for r in b.releases]
        for ra, rb in zip(a.releases, b.releases, strict=True):
            assert ra.sensitivity == pytest.approx(rb.sensitivity, rel=1e-12)
            scale = float(ra.signal.norm()) + 1e-12
            err = float((ra.signal - rb.signal).norm()) / scale
            assert err < 1e-9, f"{name} step {step} {ra.name}: bk differs by {err:.3g} (relative)"
            assert torch.allclose(ra.noise, rb.noise, rtol=1e-9, atol=1e-12)
    for pa, pb in zip(hooks.params, bk.params, strict=True):
        assert torch.allclose(pa, pb, rtol=1e-9, atol=1e-12)
    assert hooks.ledger.history == bk.ledger.history


def test_the_check_fails_when_bk_clips_differently(algo_data, monkeypatch):
    """The comparison above can fail: a bk norm off by 1 % changes the clipped signal."""
    from dpadapter.per_sample import bookkeeping

    original = bookkeeping.BookKeepingModule.per_sample_norms
    monkeypatch.setattr(
        bookkeeping.BookKeepingModule,
        "per_sample_norms",
        lambda self, params: original(self, params) * 1.01,
    )
    with pytest.raises(AssertionError, match="bk differs"):
        test_bk_makes_the_releases_of_opacus_hooks("dpsgd", algo_data, ("ft", "ft", "ft"))
