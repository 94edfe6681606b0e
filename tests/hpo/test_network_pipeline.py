"""The network regime's whole HPO in-process on the tiny synthetic config: privacy total,
test-split isolation, MLflow nesting, and the summary. One run (module fixture) is shared by the
assertions; the fit's monotone floor and the runs' `hpo.strategy` are checked on their own."""

import copy
import csv
import json
import math
import os
from dataclasses import replace
from pathlib import Path

import dp_accounting
import pytest
from tiny_config import TINY_HPO, TINY_RAW

# every test reads one run of the whole tiny HPO pipeline (a module fixture, minutes of CPU on a
# loaded machine): too long for `make check`
pytestmark = pytest.mark.slow

HPO = TINY_HPO


class ForbiddenSplit:
    """Stands in for the test split while selection runs: any use of it fails the test."""

    reads: list[str] = []

    def _fail(self, what):
        ForbiddenSplit.reads.append(what)
        raise AssertionError(f"selection code read the test split ({what})")

    def __getattr__(self, name):
        self._fail(name)

    def __len__(self):
        self._fail("len")

    def __getitem__(self, i):
        self._fail("getitem")

    def __iter__(self):
        self._fail("iter")


def _poisoned(real):
    def build_splits(cfg, roles=None):
        plan, out = real(cfg, roles)
        return plan, {k: replace(v, test=ForbiddenSplit()) for k, v in out.items()}

    return build_splits


def _scratch_checkpoint(cfg, path):
    """An untrained upstream model (what the `scratch` method writes), without its MLflow job."""
    from dpadapter.data import build_splits
    from dpadapter.models import create_model
    from dpadapter.train.checkpoint import save_model

    plan, _ = build_splits(cfg, [])
    model = create_model(cfg.model, len(cfg.public.classes), plan.in_chans, seed=0)
    save_model(
        path, model, cfg.model, len(cfg.public.classes), plan.in_chans, {"upstream": "scratch"}
    )
    return path


@pytest.fixture(scope="module")
def hpo_run(tmp_path_factory):
    import dpadapter.data
    import dpadapter.data.tasks
    from dpadapter.hpo.network import summary
    from dpadapter.hpo.network.baselines import grid_oracle, grid_run, random_search
    from dpadapter.hpo.network.final import final, fit
    from dpadapter.hpo.network.plan import plan
    from dpadapter.hpo.network.trials import sweep, trial
    from dpadapter.settings import from_dict

    wd = tmp_path_factory.mktemp("hpo")
    raw = copy.deepcopy(TINY_RAW)
    raw["hpo"] = copy.deepcopy(HPO)
    raw["privacy"]["accountant"] = "rdp"  # per-run calibration in ms; the HPO total is PLD anyway
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(wd)
        mp.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{wd / 'mlruns.db'}")
        mp.setenv("DPADAPTER_THREADS", "1")
        cfg = from_dict(raw)
        ckpt = _scratch_checkpoint(cfg, wd / "pre" / "model.pt")
        root = wd / "results" / "hpo"
        plan_path = root / "plan.json"
        trials, sweeps = [], []
        real = dpadapter.data.build_splits
        ForbiddenSplit.reads = []
        # Everything that leads to a choice runs with the test split replaced by a trap.
        mp.setattr(dpadapter.data, "build_splits", _poisoned(real))
        mp.setattr(dpadapter.data.tasks, "build_splits", _poisoned(real))
        plan(cfg, "scratch", "syn-shift", "dpsgd", 0, plan_path)
        for k in range(2):
            ks = []
            for i in range(2):
                trial(cfg, plan_path, k, i, ckpt, root / "trials" / f"s{k}" / f"t{i}")
                ks.append(root / "trials" / f"s{k}" / f"t{i}" / "metrics.json")
            sweep(cfg, plan_path, k, ks, root / f"sweep{k}.json")
            trials += ks
            sweeps.append(root / f"sweep{k}.json")
        fit(cfg, plan_path, sweeps, root / "fit.json")
        mp.setattr(dpadapter.data, "build_splits", real)
        mp.setattr(dpadapter.data.tasks, "build_splits", real)
        # Evaluation on the test split only from here on.
        final(cfg, plan_path, root / "fit.json", sweeps, trials, ckpt, root / "linear_scaling")
        random_search(cfg, plan_path, ckpt, root / "random_search")
        grid = []
        for j in range(3):
            grid_run(cfg, plan_path, j, ckpt, root / "grid" / f"p{j}")
            grid.append(root / "grid" / f"p{j}" / "metrics.json")
        grid_oracle(cfg, plan_path, grid, root / "grid_oracle.json")
        summary.run(
            [root / "linear_scaling" / "metrics.json"],
            [root / "random_search" / "metrics.json"],
            [root / "grid_oracle.json"],
            wd / "hpo.csv",
            wd / "hpo.md",
        )
        yield {"cfg": cfg, "wd": wd, "root": root, "trials": trials, "sweeps": sweeps, "ckpt": ckpt}


def _read(p):
    return json.loads(Path(p).read_text())


def _events(history):
    return [
        (
            dp_accounting.PoissonSampledDpEvent(
                s["sample_rate"], dp_accounting.GaussianDpEvent(s["noise_multiplier"])
            ),
            s["steps"],
        )
        for s in history
    ]


def test_total_epsilon_of_the_whole_hpo_is_within_target_independently_recomputed(hpo_run):
    root = hpo_run["root"]
    plan = _read(root / "plan.json")
    final = _read(root / "linear_scaling" / "metrics.json")
    h = final["hpo"]
    target = HPO["target_epsilon"]
    assert h["target_epsilon"] == target and h["total_epsilon"] <= target
    assert h["total_epsilon_recorded"] <= h["total_epsilon"] + 1e-9
    assert h["selection_accounted"] is True and h["trials"] == 4

    # Independent recomputation from the metrics.json files alone: every trial's recorded
    # history, the final run as calibrated (the plan's reference) and as recorded.
    trial_hists = [_read(p)["privacy"]["history"] for p in hpo_run["trials"]]
    assert len(trial_hists) == len(plan["sweeps"]) * HPO["trials_per_sweep"]
    for p in hpo_run["trials"]:
        m = _read(p)
        assert m["privacy"]["epsilon"] <= m["hpo"]["sweep_epsilon"] * 1.001
        assert sum(s["steps"] for s in m["privacy"]["history"]) == m["hpo"]["steps"]
    sel = [_read(p)["release"] for p in hpo_run["sweeps"]]
    assert [r["mechanism"] for r in sel] == ["exponential", "exponential"]
    sel_eps = sum(r["pure_epsilon"] for r in sel)

    def training_epsilon(final_history):
        acc = dp_accounting.pld.PLDAccountant()
        for hist in [*trial_hists, final_history]:
            for event, n in _events(hist):
                acc.compose(event, n)
        return acc.get_epsilon(plan["delta"])

    planned = training_epsilon(plan["final"]["planned_history"])
    recorded = training_epsilon(final["privacy"]["history"])
    # the reported total charges every training release and the selections (basic composition
    # bounds their share from above, so: training <= total <= training + selections)
    assert planned <= h["total_epsilon"] <= planned + sel_eps + 1e-6
    assert recorded <= h["total_epsilon_recorded"] <= recorded + sel_eps + 1e-6
    assert h["total_epsilon"] <= target
    # the final budget was not wasted: the bound is within 1% of the target
    assert h["total_epsilon"] >= 0.99 * target


def test_selection_never_read_the_test_split(hpo_run):
    # plan, trials, sweeps and fit ran with the test split replaced by ForbiddenSplit, which
    # raises on any use: a read would have failed the fixture. Trials report no test metric.
    assert ForbiddenSplit.reads == []
    for p in hpo_run["trials"]:
        m = _read(p)
        assert "test_accuracy" not in m and "test_robust_accuracy" not in m
        assert m["val_size"] == 100 and 0 <= m["val_correct"] <= 100
    with pytest.raises(AssertionError, match="test split"):
        _ = ForbiddenSplit().tensors  # the trap works
    ForbiddenSplit.reads = []


def test_fit_is_clamped_and_the_final_run_uses_it(hpo_run):
    from dpadapter.hpo.space import space_of

    root = hpo_run["root"]
    fit = _read(root / "fit.json")
    space = space_of(hpo_run["cfg"])
    sweeps = [_read(p) for p in hpo_run["sweeps"]]
    (e1, r1), (e2, r2) = [(s["epsilon"], s["r"]) for s in sweeps]
    slope = (r2 - r1) / (e2 - e1)
    assert fit["slope"] == pytest.approx(slope)
    assert fit["r_predicted"] == pytest.approx(r1 + slope * (fit["final_epsilon"] - e1))
    assert space.r_min <= fit["r_star"] <= space.r_max
    assert fit["r_star"] == pytest.approx(min(max(fit["r_predicted"], space.r_min), space.r_max))
    final = _read(root / "linear_scaling" / "metrics.json")
    c = space.decompose_max_steps(fit["r_star"])
    assert (final["hpo"]["lr"], final["hpo"]["steps"]) == (c.lr, c.steps)
    assert final["privacy"]["steps"] == c.steps


def test_trials_are_mlflow_children_of_the_hpo_parent(hpo_run):
    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{hpo_run['wd'] / 'mlruns.db'}")
    runs = mlflow.search_runs(experiment_names=["tests"])
    plan = _read(hpo_run["root"] / "plan.json")
    parent = runs[runs["run_id"] == plan["parent_run_id"]]
    assert len(parent) == 1 and parent["tags.hpo.role"].item() == "parent"
    children = runs[runs["tags.mlflow.parentRunId"] == plan["parent_run_id"]]
    roles = sorted(children["tags.hpo.role"])
    assert roles == [
        "final",
        "grid",
        "grid",
        "grid",
        "random_search",
        "trial",
        "trial",
        "trial",
        "trial",
    ]
    assert "metrics.linear_scaling_test_accuracy" in parent and not math.isnan(
        parent["metrics.total_epsilon"].item()
    )


def test_summary_csv_and_rerr_table(hpo_run):
    rows = list(csv.DictReader(open(hpo_run["wd"] / "hpo.csv")))
    assert list(rows[0])[:4] == ["method", "accuracy", "total_epsilon", "target_epsilon"]
    by = {r["method"]: r for r in rows}
    assert set(by) == {"random_search", "grid_oracle", "linear_scaling"}
    for m in ("random_search", "linear_scaling"):
        assert float(by[m]["total_epsilon"]) <= float(by[m]["target_epsilon"])
        assert by[m]["tuning_accounted"] == "True"
    assert by["grid_oracle"]["tuning_accounted"] == "False"
    assert float(by["grid_oracle"]["total_epsilon"]) > float(by["grid_oracle"]["target_epsilon"])
    md = (hpo_run["wd"] / "hpo.md").read_text()
    assert "RERR" in md and "HPO cost not incl." in md


def test_final_refuses_trials_that_released_more_than_planned(hpo_run, tmp_path, monkeypatch):
    from dpadapter.hpo.network.final import final

    root = hpo_run["root"]
    bad = tmp_path / "t.json"
    m = _read(hpo_run["trials"][0])
    m["privacy"]["history"][-1]["steps"] += 1
    bad.write_text(json.dumps(m))
    monkeypatch.chdir(hpo_run["wd"])
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{hpo_run['wd'] / 'mlruns.db'}")
    with pytest.raises(RuntimeError, match="more than planned"):
        final(
            hpo_run["cfg"],
            root / "plan.json",
            root / "fit.json",
            hpo_run["sweeps"],
            [bad, *hpo_run["trials"][1:]],
            hpo_run["ckpt"],
            tmp_path / "out",
        )
    assert not os.path.exists(tmp_path / "out" / "metrics.json")


def test_fit_stage_floors_a_negative_slope_when_monotone(tmp_path):
    from dpadapter.hpo.network.final import fit
    from dpadapter.hpo.network.plan import PLAN_VERSION
    from dpadapter.hpo.space import space_of
    from dpadapter.settings import from_dict

    cfg = from_dict(copy.deepcopy(TINY_RAW))
    plan = {"version": PLAN_VERSION, "delta": cfg.privacy.delta, "fit": "linear",
            "target_epsilon": cfg.hpo.target_epsilon, "sweeps": [{}, {}],
            "final": {"epsilon": 0.8}}  # fmt: skip
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    paths = []
    for k, (eps, r) in enumerate([(0.1, 11.0), (0.2, 5.0)]):  # noisy sweeps: negative slope
        paths.append(tmp_path / f"sweep{k}.json")
        paths[-1].write_text(json.dumps({"sweep": k, "epsilon": eps, "r": r}))
    space = space_of(cfg)
    raw = fit(cfg, tmp_path / "plan.json", paths, tmp_path / "fit.json")
    assert raw["r_predicted"] == pytest.approx(11.0 - 60.0 * 0.7)
    assert raw["r_star"] == space.r_min and raw["clamped"] and not raw["floored"]
    mono = replace(cfg, hpo=replace(cfg.hpo, monotone=True))
    floored = fit(mono, tmp_path / "plan.json", paths, tmp_path / "fit.json")
    assert floored["r_star"] == 11.0 and floored["floored"]
    assert floored["final"]["lr"] * floored["final"]["steps"] == pytest.approx(11.0)


@pytest.mark.parametrize("strategy,backbone_moves", [("ht", False), ("ft", True), ("bitfit", True)])
def test_hpo_runs_train_what_hpo_strategy_says(tmp_path, strategy, backbone_moves):
    import torch

    from dpadapter.data import build_splits
    from dpadapter.hpo.network.runner import train_config
    from dpadapter.hpo.space import StepConfig
    from dpadapter.models import create_model
    from dpadapter.settings import from_dict
    from dpadapter.train.checkpoint import save_model

    raw = copy.deepcopy(TINY_RAW)
    raw["results_dir"] = str(tmp_path)
    raw["privacy"] = {"delta": 1e-5, "accountant": "rdp"}
    raw["hpo"] = {"regime": "network", "strategy": strategy}
    cfg = from_dict(raw)
    plan, roles = build_splits(cfg, ["syn-shift"])
    model = create_model(cfg.model, 5, plan.in_chans, seed=0)
    ckpt = (
        save_model(tmp_path / "m.pt", model, cfg.model, 5, plan.in_chans, {}) or tmp_path / "m.pt"
    )
    before = {k: v.clone() for k, v in model.state_dict().items() if not k.startswith("head")}
    res = train_config(
        cfg, roles["syn-shift"].train, 5, tmp_path / "m.pt", "dpsgd", StepConfig(1.0, 2), 2.0, 0
    )
    after = {k: v for k, v in res.model.state_dict().items() if k in before}
    moved = any(not torch.equal(before[k], after[k]) for k in before)
    assert moved == backbone_moves
    if strategy == "bitfit":  # the backbone's biases and nothing else of it
        moved_keys = {k for k in before if not torch.equal(before[k], after[k])}
        assert moved_keys == {k for k in before if k.endswith(".bias")}
    assert ckpt is not None
