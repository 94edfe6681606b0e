"""Per-client audit of the federated mechanisms: honest runs within claim, broken noise caught.

The broken run is a test-only monkeypatch: the clients add noise sigma/10 while their ledgers
record sigma (MechanismRun.accounted_multiplier patched for this test only).
"""

import dataclasses

import pytest

import dpadapter.audit.federated as F
from dpadapter.audit.federated import audit_federated_run
from dpadapter.federated.simulation import MechanismRun

AUDIT = {"canaries": 1000, "guesses": (100, 250), "task": "syn-same"}


@pytest.fixture
def fed_cfg(tiny_cfg):
    fed = dataclasses.replace(
        tiny_cfg.federated,
        task="syn-same",
        clients=3,
        min_client_size=20,
        rounds=30,
        gaussian=dataclasses.replace(tiny_cfg.federated.gaussian, sample_rate=0.3),
    )
    return dataclasses.replace(
        tiny_cfg,
        federated=fed,
        audit=dataclasses.replace(tiny_cfg.audit, **AUDIT),
        privacy=dataclasses.replace(tiny_cfg.privacy, accountant="rdp"),
    )


@pytest.mark.parametrize("mechanism", ["gaussian", "laplace"])
def test_federated_mechanism_stays_within_its_claim(fed_cfg, mechanism):
    r = audit_federated_run(fed_cfg, mechanism, 2.0)
    assert r["steps"] == 30 and 1.9 < r["claimed_epsilon"] <= 2.0 * 1.001
    assert r["epsilon_lb"] <= r["claimed_epsilon"], r["best_test"]


def test_federated_noise_divided_by_10_exceeds_the_claim(fed_cfg, monkeypatch):
    plan = F.plan_noise
    monkeypatch.setattr(F, "plan_noise", lambda *a: (plan(*a)[0] / 10, None, 0.0))
    monkeypatch.setattr(
        MechanismRun, "accounted_multiplier", property(lambda s: s.noise_multiplier * 10)
    )
    r = audit_federated_run(fed_cfg, "gaussian", 1.0)
    assert 0.9 < r["claimed_epsilon"] <= 1.001  # the ledger claims eps = 1 ...
    assert r["epsilon_lb"] > r["claimed_epsilon"], r["best_test"]  # ... the audit refutes it
