"""The federated stage on the tiny synthetic task: metrics.json and its privacy block."""

import json

import pytest

from dpadapter.privacy import Segment, epsilon_from_history, pld_epsilon
from dpadapter.settings import from_dict

FED = {
    "task": "syn-shift",
    "clients": 3,
    "min_client_size": 20,
    "rounds": 3,
    "seeds": [0],
    "ut_t1": "rule",
    "estimate_directions": 1,
    "eval_every": 2,
    "gaussian": {"epsilons": [2.0], "max_grad_norm": 1.0, "lr": 0.5, "sample_rate": 0.5},
    "laplace": {"epsilons": [50.0], "max_grad_norm": 5.0, "lr": 0.5, "estimate_fraction": 0.1},
}


@pytest.fixture
def fed_cfg(tiny_raw, tiny_cfg, tmp_path):
    from dpadapter.stages import pretrain

    # RDP: calibrations take milliseconds (PRV's bisection takes seconds); the PRV ledger is
    # checked against an independent recomputation in test_mechanisms.
    cfg = from_dict({**tiny_raw, "federated": FED, "privacy": {"delta": 1e-5, "accountant": "rdp"}})
    pretrain.run(cfg, "scratch", tmp_path / "pre", None)
    return cfg, tmp_path / "pre" / "model.pt"


@pytest.mark.slow  # in-process, too long for `make check`
def test_gaussian_ut_rule_job(fed_cfg, tmp_path):
    from dpadapter.federated import stage

    cfg, ckpt = fed_cfg
    m = stage.run(cfg, "scratch", "ut", "gaussian", 2.0, 3, 0, ckpt, tmp_path / "g")
    assert (
        json.loads((tmp_path / "g" / "metrics.json").read_text())["test_accuracy"]
        == m["test_accuracy"]
    )
    p = m["privacy"]
    assert p["mechanism"] == "gaussian" and p["dp_level"] == "sample"
    assert "add/remove" in p["adjacency"] and p["delta"] == 1e-5
    assert m["predicted_best"] in ("ht", "ft")
    assert m["schedule"]["t1"] == (3 if m["predicted_best"] == "ht" else 0)
    assert sum(m["federation"]["client_sizes"]) == 400
    sigma = p["noise_multiplier"]
    sigma_e = p["estimation"]["noise"]
    for c in p["clients"]:
        hist = [Segment(**s) for s in c["history"]]
        # the estimate's release (q = 1) and then every round's, in one ledger per client
        assert [s.as_tuple() for s in hist] == [(sigma_e, 1.0, 1), (sigma, 0.5, 3)]
        assert c["steps"] == 4 == p["releases_per_client"]
        assert c["epsilon"] <= 2.0 * 1.001
        assert c["epsilon"] == epsilon_from_history(hist, 1e-5, "rdp")
        assert pld_epsilon(hist, 1e-5) <= c["epsilon"]  # RDP is an upper bound of the PLD
    assert p["epsilon"] == max(c["epsilon"] for c in p["clients"])
    rule = m["rule"]
    assert rule["rounds"] == 3 and rule["p"] > rule["n"] > 0
    assert set(rule["constants"]) == {"G1_sq", "G2_sq", "Lambda1_sq", "Lambda2_sq", "L", "Gamma"}


def test_laplace_jobs_spend_exactly_their_pure_budget(fed_cfg, tmp_path):
    from dpadapter.federated import stage
    from dpadapter.federated.mechanisms import theorem1_scale

    cfg, ckpt = fed_cfg
    m = stage.run(cfg, "scratch", "ut", "laplace", 50.0, 3, 0, ckpt, tmp_path / "l")
    p = m["privacy"]
    assert p["mechanism"] == "laplace" and p["delta"] == 0.0 and p["clipping"] == "l1"
    assert p["estimation"]["epsilon_alone"] == pytest.approx(5.0)
    for c, scale in zip(p["clients"], p["laplace_scale_per_client"], strict=True):
        assert c["epsilon"] == pytest.approx(50.0, rel=1e-9)  # estimate 5 + training 45
        assert scale == pytest.approx(theorem1_scale(3, 5.0, c["n"], 45.0))
    s = stage.run(cfg, "scratch", "scratch", "laplace", 50.0, 3, 0, ckpt, tmp_path / "s")
    assert s["schedule"]["t1"] == 0 and s["rule"] is None and s["predicted_best"] is None
    sp = s["privacy"]
    for c, scale in zip(sp["clients"], sp["laplace_scale_per_client"], strict=True):
        assert c["epsilon"] == pytest.approx(50.0, rel=1e-9)
        assert scale == pytest.approx(theorem1_scale(3, 5.0, c["n"], 50.0))
