"""The linear-probe regime: features, full-batch DP-GD and its accounting, the exact random-search
expectation, the premise check and one HPO replicate."""

import copy
import math

import numpy as np
import pytest
import torch
from tiny_config import TINY_RAW

from dpadapter.hpo.accounting import Composition
from dpadapter.hpo.probe import dpgd, features, oracle, privacy, replicate
from dpadapter.privacy import Segment
from dpadapter.settings import ConfigError, from_dict

DELTA = 1e-5


def _gdp_epsilon(mu: float, delta: float) -> float:
    """Closed-form eps(delta) of mu-GDP (Dong, Roth & Su 2022, Cor. 2.13), by bisection."""
    from scipy.stats import norm

    def d(eps):
        return norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * norm.cdf(-eps / mu - mu / 2)

    lo, hi = 0.0, 100.0
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if d(mid) > delta else (lo, mid)
    return hi


# --- accounting of full-batch DP-GD ---------------------------------------------------------------
@pytest.mark.parametrize("sigma,steps", [(30.0, 200), (5.0, 1), (80.0, 37)])
def test_full_batch_history_is_one_gaussian_of_mu_sqrt_t_over_sigma(sigma, steps):
    eps = Composition(((Segment(sigma, 1.0, steps),),)).epsilon(DELTA)
    exact = _gdp_epsilon(math.sqrt(steps) / sigma, DELTA)
    assert exact <= eps <= exact * 1.01 + 1e-3  # an upper bound, and a tight one
    # the same as composing the T releases one by one (the generic path)
    from dp_accounting.pld import privacy_loss_distribution as pld

    one = pld.from_gaussian_mechanism(standard_deviation=sigma, value_discretization_interval=3e-4)
    composed = one.self_compose(steps).get_epsilon_for_delta(DELTA)
    assert eps == pytest.approx(composed, rel=0.01, abs=1e-3)


def test_calibrated_runs_meet_their_budget_for_any_number_of_steps():
    for eps in (0.05, 0.5, 2.0):
        s1 = privacy.single_release_sigma(eps, DELTA)
        spent = [Composition((privacy.run_history(s1, t),)).epsilon(DELTA) for t in (1, 13, 200)]
        assert all(e <= eps + 1e-9 for e in spent)
        assert min(spent) >= 0.99 * eps  # not wastefully loose
        assert max(spent) - min(spent) < 1e-6  # the PLD does not depend on T at equal mu


def test_final_budget_keeps_the_composition_within_target():
    s1 = privacy.single_release_sigma(0.1, DELTA)
    spent = Composition(
        tuple(privacy.run_history(s1, t) for t in (5, 50, 200)),
        ({"mechanism": "exponential", "pure_epsilon": 0.05},),
    )
    sf = privacy.final_sigma(spent, DELTA, 1.0)
    total = Composition((*spent.histories, privacy.run_history(sf, 77)), spent.releases)
    assert 0.99 <= total.epsilon(DELTA) <= 1.0
    with pytest.raises(ValueError, match="already spend"):
        privacy.final_sigma(spent, DELTA, 0.1)


# --- training --------------------------------------------------------------------------------
def test_clipped_gradient_sum_matches_autograd_per_example():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 4, generator=g) * 3
    y = torch.randint(0, 3, (7,), generator=g)
    w = torch.randn(2, 4, 3, generator=g)
    y1 = torch.nn.functional.one_hot(y, 3).float()
    got = dpgd.clipped_grad_sum(x, y1, w, clip=0.5)
    for k in range(2):
        want = torch.zeros(4, 3)
        for i in range(7):
            wk = w[k].clone().requires_grad_(True)
            torch.nn.functional.cross_entropy((x[i] @ wk)[None], y[i : i + 1]).backward()
            gi = wk.grad
            want += gi * min(1.0, 0.5 / float(gi.norm()))
        assert torch.allclose(got[k], want, atol=1e-5)


def test_runs_stop_after_their_own_steps_and_noise_is_per_seed():
    g = torch.Generator().manual_seed(1)
    data = features.Split(torch.randn(50, 6, generator=g), torch.randint(0, 3, (50,), generator=g))
    a = dpgd.Run(0.5, 3, 20.0, 7)
    b = dpgd.Run(0.5, 10, 20.0, 8)
    both = dpgd.train(data, 3, [a, b], 0.9, 1.0)
    alone = dpgd.train(data, 3, [a], 0.9, 1.0)
    assert torch.allclose(both[0], alone[0], atol=1e-6)  # batching changes nothing
    assert not torch.allclose(both[0], both[1])
    zero = dpgd.train(data, 3, [dpgd.Run(0.5, 0, 1.0, 0)], 0.9, 1.0)
    assert torch.count_nonzero(zero) == 0  # zero initialisation


# --- baselines and premise -------------------------------------------------------------------
def test_random_search_is_the_exact_expectation_over_the_grid():
    accs = [0.2, 0.9, 0.5, 0.4]
    assert oracle.random_search_expectation(accs) == pytest.approx(np.mean(accs))
    # against simulation: a uniformly drawn grid point, many times
    rng = np.random.default_rng(0)
    sim = np.mean([accs[i] for i in rng.integers(len(accs), size=200_000)])
    assert oracle.random_search_expectation(accs) == pytest.approx(sim, abs=3e-3)
    with pytest.raises(ValueError):
        oracle.random_search_expectation([])


def test_premise_detects_linear_rise_and_its_absence():
    up = oracle.premise({0.1: 10.0, 0.5: 52.0, 1.0: 98.0, 2.0: 205.0})
    assert up["holds"] and up["slope"] > 0 and up["r2"] > 0.99
    down = oracle.premise({0.1: 200.0, 0.5: 90.0, 1.0: 40.0, 2.0: 10.0})
    assert not down["holds"] and down["slope"] < 0
    flat = oracle.premise({0.1: 5.0, 0.5: 5.0, 1.0: 5.0})
    assert not flat["holds"]


# --- features ----------------------------------------------------------------------------------
def test_features_are_the_classifier_inputs_at_unit_norm():
    from dpadapter.models import create_model
    from dpadapter.settings import ModelConfig

    model = create_model(ModelConfig(name="cnn-gn", groups=4, width=8), 5, 1, seed=0)
    x = torch.randn(9, 1, 28, 28)
    f = features.extract(model, x, batch_size=4)
    with torch.no_grad():
        raw = torch.flatten(model.pool(model.features(x)), 1)
    assert f.shape == (9, 16)
    assert torch.allclose(f, raw / raw.norm(dim=1, keepdim=True), atol=1e-6)
    assert torch.allclose(f.norm(dim=1), torch.ones(9), atol=1e-5)


def test_features_refuse_a_model_that_mixes_examples_in_eval_mode():
    """Extraction runs in batches: a per-batch statistic would leak across examples."""
    from dpadapter.per_sample import MixedExamplesError

    class Centre(torch.nn.Module):
        def forward(self, x):
            return x - x.mean(0, keepdim=True)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.head = Centre(), torch.nn.Linear(4, 3)

        def forward(self, x):
            return self.head(self.body(x))

        def get_classifier(self):
            return self.head

    with pytest.raises(MixedExamplesError, match=r"eval mode, 'body' \(Centre\)"):
        features.extract(Net(), torch.randn(9, 4), batch_size=4)


# --- one replicate end to end, on tiny synthetic features ----------------------------------------
def _probe_cfg(tmp_path, **hpo):
    raw = copy.deepcopy(TINY_RAW)
    raw["results_dir"] = str(tmp_path)
    raw["hpo"] = {
        "regime": "linear-probe",
        "upstreams": ["scratch"],
        "tasks": ["syn-shift"],
        "seeds": [0],
        "target_epsilons": [1.0, 2.0],
        "sweep_epsilons": [0.1, 0.2],
        "trials_per_sweep": 2,
        "lr_range": [0.05, 2.0],
        "steps_range": [1, 20],
        "grid_size": 5,
        "oracle_seeds": 2,
        **hpo,
    }
    return from_dict(raw)


def _features(tmp_path):
    g = torch.Generator().manual_seed(3)
    centers = torch.randn(5, 8, generator=g)

    def split(n):
        y = torch.randint(0, 5, (n,), generator=g)
        x = centers[y] + 2.5 * torch.randn(n, 8, generator=g)
        return {"x": x / x.norm(dim=1, keepdim=True), "y": y}

    path = tmp_path / "features.pt"
    torch.save({"num_classes": 5, "train": split(300), "val": split(100), "test": split(100)}, path)
    return path


def test_one_replicate_accounts_everything_and_labels_the_raw_selection(tmp_path, monkeypatch):
    cfg = _probe_cfg(tmp_path)
    path = _features(tmp_path)
    loads = []
    real = replicate.load_data
    monkeypatch.setattr(
        replicate, "load_data", lambda p, with_test: loads.append(with_test) or real(p, with_test)
    )
    out = replicate.seed_run(cfg, path, 0)
    assert loads[0] is False and loads[-1] is True  # trials and selections never see test
    trial_hists = [tuple(Segment(**s) for s in t["history"]) for t in out["trials"]]
    for t, h in zip(out["trials"], trial_hists, strict=True):
        assert h[0].sample_rate == 1.0 and h[0].steps == t["steps"]
        assert t["epsilon"] <= t["sweep_epsilon"] + 1e-9
    acc = out["selections"]["accounted"]
    raw = out["selections"]["raw"]
    assert acc["accounted"] and not raw["accounted"] and "NOT covered" in raw["label"]
    for target in (1.0, 2.0):
        a = acc["targets"][f"{target:g}"]
        final = tuple(Segment(**s) for s in a["history"])
        total = Composition((*trial_hists, final), tuple(acc["releases"])).epsilon(DELTA)
        assert total == pytest.approx(a["total_epsilon"]) and total <= target + 1e-9
        assert a["covered_by_guarantee"] and 0 <= a["test_accuracy"] <= 1
        assert not raw["targets"][f"{target:g}"]["covered_by_guarantee"]
        # the raw selection pays no selection cost, so its final run gets more budget
        assert raw["targets"][f"{target:g}"]["final_epsilon"] > a["final_epsilon"]


def test_oracle_and_summary(tmp_path):
    from dpadapter.hpo.probe import summary as probe_summary

    cfg = _probe_cfg(tmp_path)
    path = _features(tmp_path)
    o = oracle.oracle(cfg, path)
    assert sorted(o["budgets"]) == ["0.1", "0.2", "1", "2"]
    b = o["budgets"]["1"]
    assert len(b["grid"]) == 5 and all(len(g["test_accuracy"]) == 2 for g in b["grid"])
    assert b["random_search_expected_test"] == pytest.approx(
        np.mean([g["mean_test"] for g in b["grid"]])
    )
    assert b["best_index"] == int(np.argmax([g["mean_val"] for g in b["grid"]]))
    seeds = [replicate.seed_run(cfg, path, s) for s in (0, 1, 2)]
    key = ("scratch", "syn-shift")
    rows, result = probe_summary.summarise({key: o}, {key: seeds})
    cell = result["cells"][0]
    assert set(cell["targets"]) == {"1", "2"} and set(cell["sweep_budgets"]) == {"0.1", "0.2"}
    e = cell["targets"]["1"]["accounted"]
    if b["margin"] > 0:
        rerr = [(a - b["random_search_expected_test"]) / b["margin"] for a in e["accuracy"]]
        assert e["rerr"] == pytest.approx(rerr)
    else:  # the oracle does not beat random search: RERR is undefined, not a number
        assert all(math.isnan(r) for r in e["rerr"])
    ci = e["rerr_interval"]
    assert ci["method"] == "t" and ci["n"] == 3
    assert math.isnan(ci["estimate"]) or ci["low"] <= ci["estimate"] <= ci["high"]
    md = probe_summary.markdown(result)
    assert "Premise" in md and "NOT covered" in md and "RERR" in md
    assert "(n=3)" in md and "How to read this" in md  # three HPO seeds per accuracy cell


# --- config ------------------------------------------------------------------------------------
def test_linear_probe_needs_targets_above_the_sweeps(tmp_path):
    with pytest.raises(ConfigError, match="target_epsilons"):
        _probe_cfg(tmp_path, target_epsilons=[0.15, 1.0])


def test_hpo_only_task_is_left_out_of_the_finetune_grid():
    raw = copy.deepcopy(TINY_RAW)
    raw["tasks"]["syn-hpo"] = {**raw["tasks"]["syn-shift"], "n_train": 50, "grids": False}
    cfg = from_dict(raw)
    assert "syn-hpo" not in {t for _, t, *_ in cfg.finetune_grid()}
    assert cfg.grid_tasks() == ("syn-same", "syn-shift")


def test_default_config_carves_the_hpo_task_beside_the_others():
    """config.yaml's fmnist-shift-hpo fits in Fashion-MNIST and leaves the other splits as they
    are (it is allocated last)."""
    from pathlib import Path

    import yaml

    from dpadapter.data.tasks import allocate, load_pools

    raw = yaml.safe_load((Path(__file__).parents[2] / "config.yaml").read_text())
    cfg = from_dict(raw)
    try:
        pools = load_pools(cfg)
    except (FileNotFoundError, RuntimeError) as exc:  # no Fashion-MNIST on this machine
        pytest.skip(f"Fashion-MNIST not available: {exc}")
    a = allocate(cfg, pools)
    h = a["fmnist-shift-hpo"]
    assert (h.train.numel(), h.val.numel(), h.test.numel()) == (10_000, 5_000, 2_500)
    without = copy.deepcopy(raw)
    del without["tasks"]["fmnist-shift-hpo"]
    b = allocate(from_dict(without), pools)
    for name in ("public", "fmnist-same", "fmnist-shift"):
        for part in ("train", "val", "test"):
            assert torch.equal(getattr(a[name], part), getattr(b[name], part))
    fm = [r for r in a.values() if r.dataset == "fashion-mnist"]
    for pool in ("train", "test"):  # disjoint in each source split, whichever role takes them
        used = torch.cat(
            [r.train for r in fm if r.train_split == pool]
            + [r.val for r in fm if r.train_split == pool]
            + [r.test for r in fm if r.test_split == pool]
        )
        assert used.unique().numel() == used.numel(), pool
