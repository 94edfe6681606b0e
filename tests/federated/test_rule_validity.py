"""The T1 rule's validity checks: the step-size assumption, constants along the trajectory, the
statistics' clipping unit, and the hit rate's interval against always-HT / always-FT / a coin."""

import copy
import json

import pytest
from fed_helpers import make_data, make_gsm

from dpadapter.federated.estimate import (
    RuleConstants,
    _clipped_sums,
    decide,
    trajectory_constants,
)
from dpadapter.federated.stage import estimate_points
from dpadapter.federated.summary import baselines, rule_report
from dpadapter.ground.stats import binomial_interval, t_interval
from dpadapter.privacy import Segment, epsilon_from_history
from dpadapter.settings import from_dict

# every job tracks into tmp_path/mlruns.db: made from a template, not migrated each time
pytestmark = pytest.mark.usefixtures("empty_mlflow_store")

C = RuleConstants(G1_sq=0.4, G2_sq=0.6, Lambda1_sq=0.05, Lambda2_sq=0.08, L=3.0, Gamma=0.2)


def test_step_size_assumption_is_checked_with_the_estimated_L():
    ok = decide(C, 20, 4, 0.1, 6000, 85, 1e-3)  # 0.1 < 1/(2*3)
    assert ok.step_size_condition and ok.lr_bound == pytest.approx(1 / 6)
    bad = decide(C, 20, 4, 0.2, 6000, 85, 1e-3)  # 0.2 >= 1/6
    assert not bad.step_size_condition and bad.lr == 0.2
    # the check uses L_check (the largest L along the trajectory) when given
    strict = decide(C, 20, 4, 0.1, 6000, 85, 1e-3, L_check=10.0)
    assert not strict.step_size_condition and strict.lr_bound == pytest.approx(0.05)
    assert strict.t1 == ok.t1  # the decision itself uses the (mean) constants


def test_trajectory_constants_are_the_mean_of_the_points():
    other = RuleConstants(G1_sq=0.2, G2_sq=0.2, Lambda1_sq=0.01, Lambda2_sq=0.02, L=1.0, Gamma=0.0)
    m = trajectory_constants([C, other])
    assert m.L == pytest.approx(2.0) and m.G2_sq == pytest.approx(0.4)
    with pytest.raises(ValueError):
        trajectory_constants([])


def test_estimation_points_are_spread_over_the_first_half():
    assert estimate_points(20, 1) == [0]
    assert estimate_points(20, 3) == [0, 3, 6]
    assert estimate_points(4, 2) == [0, 1]
    with pytest.raises(ValueError):
        estimate_points(1, 2)


def test_laplace_statistics_are_clipped_in_l1_like_its_training():
    """With an l1 training clip, the statistics' extra bound is an l1 bound too, so every
    clipped per-example gradient (hence their mean) has l1 norm <= stat_clip. An l2 bound (the
    old code) leaves l1 norms up to sqrt(p) times larger."""
    _, gsm = make_gsm(0)
    x, y = make_data(40).tensors
    stat_clip = 0.05
    full, _, _, _ = _clipped_sums(gsm, x, y, 100.0, "l1", 16, True, stat_clip)
    mean_l1 = sum(float(t.abs().sum()) for t in full) / len(y)
    assert mean_l1 <= stat_clip * (1 + 1e-4)
    # and the per-example l1 norms are at the bound (the gradients are longer than 0.05 in l1)
    one, _, _, _ = _clipped_sums(gsm, x[:1], y[:1], 100.0, "l1", 16, True, stat_clip)
    assert sum(float(t.abs().sum()) for t in one) == pytest.approx(stat_clip, rel=1e-3)


def test_wilson_and_t_intervals_match_references():
    ci = binomial_interval(5, 10)
    assert (ci.low, ci.high) == pytest.approx((0.2366, 0.7634), abs=1e-4)  # Wilson 95 %
    cp = binomial_interval(5, 10, method="exact")
    assert (cp.low, cp.high) == pytest.approx((0.1871, 0.8129), abs=1e-4)  # Clopper-Pearson
    t = t_interval([1.0, 2.0, 3.0, 4.0, 5.0])
    assert t.estimate == 3.0 and (t.low, t.high) == pytest.approx((1.0367, 4.9633), abs=1e-4)


def _cell(winner, predicted):
    return {"winner": winner, "hit": winner == predicted}


def test_hit_rate_against_always_ht_always_ft_and_a_coin():
    cells = [_cell("ht", "ht")] * 8 + [_cell("ft", "ft")] * 2
    b = baselines(cells)
    assert b["always_ht"] == 0.8 and b["always_ft"] == pytest.approx(0.2) and b["coin"] == 0.5
    assert b["hit_rate_interval"]["estimate"] == 1.0
    assert b["better_than_coin"] and b["better_than_always_ft"]
    assert not b["better_than_always_ht"]  # Wilson low for 10/10 is 0.72 < 0.8
    worse = baselines([_cell("ht", "ft")] * 6 + [_cell("ft", "ft")] * 4)
    assert worse["hit_rate_interval"]["estimate"] == 0.4 and not worse["better_than_coin"]


def test_rule_report_counts_the_step_size_assumption():
    rows = [
        {
            "upstream": "u",
            "mechanism": "gaussian",
            "epsilon": e,
            "rounds": 20,
            "strategy": s,
            "mean_accuracy": a,
            "std_accuracy": 0.0,
            "n_seeds": 5,
        }  # fmt: skip
        for e, s, a in [(1.0, "ht", 0.7), (1.0, "ft", 0.6), (2.0, "ht", 0.5), (2.0, "ft", 0.8)]
    ]
    preds = {("u", "gaussian", 1.0, 20): ["ht"] * 5, ("u", "gaussian", 2.0, 20): ["ht"] * 5}
    flags = {("u", "gaussian", 1.0, 20): [True] * 5, ("u", "gaussian", 2.0, 20): [True, False]}
    r = rule_report(rows, preds, flags)
    assert r["hits"] == 1 and r["n_cells"] == 2
    assert r["step_size_jobs_holding"] == 6 and r["step_size_jobs"] == 7
    assert r["n_cells_step_size_holds"] == 1
    assert r["hit_rate_step_size_holds"]["estimate"] == 1.0
    assert r["hit_rate_interval"]["method"] == "Wilson"


@pytest.mark.slow  # in-process, too long for `make check`
@pytest.mark.parametrize("mechanism,eps", [("gaussian", 2.0), ("laplace", 50.0)])
def test_rule_job_estimates_along_the_trajectory_within_its_budget(
    tiny_raw, tmp_path, monkeypatch, mechanism, eps
):
    from dpadapter.federated import stage
    from dpadapter.stages import pretrain

    monkeypatch.chdir(tmp_path)  # results_dir "results" (its MLflow artifacts) is the test's own

    fed = {
        "task": "syn-shift",
        "clients": 3,
        "min_client_size": 20,
        "rounds": 4,
        "seeds": [0],
        "ut_t1": "rule",
        "estimate_points": 2,
        "estimate_directions": 1,
        "eval_every": 2,
        "gaussian": {"epsilons": [2.0], "max_grad_norm": 1.0, "lr": 0.5, "sample_rate": 0.5},
        "laplace": {
            "epsilons": [50.0],
            "max_grad_norm": 5.0,
            "lr": 0.5,
            "estimate_fraction": 0.1,
        },  # fmt: skip
    }
    raw = copy.deepcopy(tiny_raw)
    cfg = from_dict({**raw, "federated": fed, "privacy": {"delta": 1e-5, "accountant": "rdp"}})
    pretrain.run(cfg, "scratch", tmp_path / "pre", None)
    m = stage.run(cfg, "scratch", "ut", mechanism, eps, 4, 0, tmp_path / "pre" / "model.pt",
                  tmp_path / "out")  # fmt: skip
    rule = m["rule"]
    assert [p["round"] for p in rule["trajectory"]] == [0, 1]
    assert m["privacy"]["estimation"]["points"] == [0, 1]
    assert rule["t1_run"] in (4, 1) and m["schedule"]["t1"] == rule["t1_run"]
    assert (rule["t1_run"] == 4) == (m["predicted_best"] == "ht")
    assert (
        isinstance(rule["step_size_condition"], bool) and "1/(2L)" in rule["step_size_assumption"]
    )
    assert rule["L_check"] == pytest.approx(max(p["constants"]["L"] for p in rule["trajectory"]))
    p = m["privacy"]
    assert p["releases_per_client"] == 4 + 2
    for c in p["clients"]:
        hist = [Segment(**s) for s in c["history"]]
        assert c["epsilon"] <= eps * 1.001
        if mechanism == "gaussian":
            est = [s for s in hist if s.sample_rate == 1.0]
            assert sum(s.steps for s in est) == 2  # two estimation releases, both in the ledger
            assert c["epsilon"] == epsilon_from_history(hist, 1e-5, "rdp")
    saved = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert saved["rule"]["trajectory"] == rule["trajectory"]


def test_too_many_estimation_points_are_refused_before_any_job(tiny_raw):
    from dpadapter.validation.compose import ConfigError, validate

    fed = {"task": "syn-shift", "rounds": 3, "rounds_sweep": [], "ut_t1": "rule"}
    validate({**copy.deepcopy(tiny_raw), "federated": {**fed, "estimate_points": 3}})
    with pytest.raises(ConfigError, match="estimate_points: 4 points do not fit in 3 rounds"):
        validate({**copy.deepcopy(tiny_raw), "federated": {**fed, "estimate_points": 4}})
