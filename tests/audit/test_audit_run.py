"""The audit on real training runs: blatant mutants are caught, real algorithms stay within claim.

Tiny synthetic task (300 real 16x16 images), 1000 canaries, 96 steps: a run takes seconds.
The mutants (tests/audit/audit_mutants.py) are put into the registry for one test only.
"""

import dataclasses

import pytest
from audit_mutants import (
    ClipSkippedForWeight,
    NoiseDividedBy10,
    NonPrivate,
)

from dpadapter.algorithms import ALGORITHMS
from dpadapter.audit.canaries import audit_run

AUDIT = {"canaries": 1000, "guesses": (100, 250), "epochs": 6, "task": "syn-same"}


@pytest.fixture
def audit_cfg(tiny_cfg):
    # RDP: calibrating sigma takes milliseconds (PRV's bisection takes seconds per run)
    return dataclasses.replace(
        tiny_cfg,
        audit=dataclasses.replace(tiny_cfg.audit, **AUDIT),
        privacy=dataclasses.replace(tiny_cfg.privacy, accountant="rdp"),
    )


def _audit_mutant(monkeypatch, cfg, cls, eps):
    """The mutants break Opacus' clip phase (`clip_and_accumulate` over `grad_sample`), which
    bk, the default mode, replaces: they run in hooks mode."""
    cfg = dataclasses.replace(
        cfg, finetune=dataclasses.replace(cfg.finetune, grad_sample_mode="hooks")
    )
    name = f"mutant-{cls.__name__.lower()}"
    monkeypatch.setitem(ALGORITHMS, name, type(cls.__name__, (cls,), {"name": name}))
    return audit_run(cfg, name, eps)


def test_non_private_run_gives_a_large_lower_bound(audit_cfg, monkeypatch):
    r = _audit_mutant(monkeypatch, audit_cfg, NonPrivate, 1.0)
    assert r["claimed_epsilon"] <= 1.0  # the ledger still claims eps = 1 ...
    assert r["epsilon_lb"] > 4.0, r["best_test"]  # ... the audit proves eps > 4


@pytest.mark.parametrize("eps", [1.0, 2.0])
def test_noise_divided_by_10_exceeds_the_claim(audit_cfg, monkeypatch, eps):
    r = _audit_mutant(monkeypatch, audit_cfg, NoiseDividedBy10, eps)
    assert r["epsilon_lb"] > r["claimed_epsilon"], r["best_test"]
    assert not r["within_claim"]


def test_clipping_skipped_on_the_canary_layer_exceeds_the_claim(audit_cfg, monkeypatch):
    r = _audit_mutant(monkeypatch, audit_cfg, ClipSkippedForWeight, 1.0)
    assert r["epsilon_lb"] > r["claimed_epsilon"], r["best_test"]


@pytest.mark.parametrize("algo", sorted(ALGORITHMS))
def test_registered_algorithm_stays_within_its_claim(audit_cfg, algo):
    """The audit that catches the mutants above, at half their steps (to keep the suite fast)."""
    cfg = dataclasses.replace(audit_cfg, audit=dataclasses.replace(audit_cfg.audit, epochs=3))
    r = audit_run(cfg, algo, 2.0)
    # the run went through dp_fit's accounting: every step recorded, the claim is the target
    assert r["steps"] == 3 * int(1 / r["sample_rate"])
    assert 1.9 < r["claimed_epsilon"] <= 2.0 * 1.001
    assert r["epsilon_lb"] <= r["claimed_epsilon"], r["best_test"]
    assert r["within_claim"]
    assert len(r["tests"]) == 4 and r["canaries"] == 1000


def test_the_audited_noise_is_the_one_calibration(audit_cfg):
    """The audit measures the sigma the pipeline's one calibration (privacy.calibration) sets."""
    from dpadapter.privacy import calibrate_sigma

    cfg = dataclasses.replace(audit_cfg, audit=dataclasses.replace(audit_cfg.audit, epochs=1))
    r = audit_run(cfg, "dpsgd", 2.0)
    want = calibrate_sigma(2.0, cfg.privacy.delta, r["sample_rate"], r["steps"], "rdp")
    assert r["noise_multiplier"] == want
