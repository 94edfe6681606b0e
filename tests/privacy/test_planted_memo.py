"""A results folder's accountant memo (`<results_dir>/.cache/*.json`) is a shortcut for planning,
never a source of a guarantee: a stale or edited entry must not set the noise of a run that then
trains, nor stand in for the epsilon a run prints, records or checks.

Each test runs the real code once so that the memo holds the entries it uses, overwrites every
entry with a wrong value (sigma 0.3, as an edited folder did, and epsilon 0.99), and runs again.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dpadapter.privacy import CalibrationError, Segment, epsilon_from_history, memo
from dpadapter.settings import from_dict

PLANTED_SIGMA = 0.3
PLANTED_EPSILON = 0.99


def _plant(cache_dir: Path, sigma: float | None, epsilon: float | None) -> list[str]:
    """Overwrite every sigma memo entry with `sigma` and every epsilon entry with `epsilon`
    (None: leave that kind alone); the process's memory of them is dropped, as in a new job."""
    planted = []
    for path in sorted(cache_dir.glob("*.json")):
        value = epsilon if path.name == "epsilon.json" else sigma
        if value is None:
            continue
        data = json.loads(path.read_text())
        keys = list(data)
        if path.name == "epsilon.json" and sigma is not None:
            keys += [_with_sigma(k, sigma) for k in data]  # the planted sigma's histories too
        path.write_text(json.dumps(dict.fromkeys(keys, value)))
        planted += list(data)
    memo.clear_memory()
    return planted


def _with_sigma(key: str, sigma: float) -> str:
    """An epsilon memo key (its last item the history's (sigma, q, steps) rows) for the same
    history at `sigma`: what an edited folder holds for the run that its planted sigma makes."""
    k = json.loads(key)
    k[-1] = [[sigma, *row[1:]] for row in k[-1]]
    return json.dumps(k)


@pytest.fixture
def scratch_ckpt(tiny_cfg, tmp_path):
    from dpadapter.stages import pretrain

    pretrain.run(tiny_cfg, "scratch", tmp_path / "pre", None)
    return tmp_path / "pre" / "model.pt"


def _finetune(cfg, ckpt, out: Path, algo: str = "dpsgd") -> dict:
    from dpadapter.stages import finetune

    return finetune.run(cfg, "scratch", "syn-shift", algo, 2.0, 0, ckpt, out)


@pytest.mark.parametrize("algo, accountant", [("dpsgd", "prv"), ("adpalloc", "rdp")])
def test_finetune_refuses_a_planted_sigma_before_training(
    tiny_raw, tiny_cfg, scratch_ckpt, tmp_path, algo, accountant
):
    cfg = from_dict({**tiny_raw, "privacy": {"delta": 1e-5, "accountant": accountant}})
    _finetune(cfg, scratch_ckpt, tmp_path / "first", algo)
    assert _plant(Path(cfg.results_dir) / ".cache", PLANTED_SIGMA, PLANTED_EPSILON)
    with pytest.raises(CalibrationError, match="exceeds the target"):
        _finetune(cfg, scratch_ckpt, tmp_path / "planted", algo)
    assert not (tmp_path / "planted" / "metrics.json").exists()
    memo.clear_memory()


@pytest.mark.slow  # over ~1.5 s: make check's 2 minutes (docs/testing.md)
def test_finetune_prints_and_checks_the_accountants_epsilon_not_a_memo(
    tiny_cfg, scratch_ckpt, tmp_path
):
    first = _finetune(tiny_cfg, scratch_ckpt, tmp_path / "first")
    # an epsilon memo, if the code keeps one, now says 0.99 for every history it holds
    cache = Path(tiny_cfg.results_dir) / ".cache"
    if (cache / "epsilon.json").is_file():
        _plant(cache, None, PLANTED_EPSILON)
    again = _finetune(tiny_cfg, scratch_ckpt, tmp_path / "again")
    hist = [Segment(**s) for s in again["privacy"]["history"]]
    true = epsilon_from_history(hist, 1e-5, "prv")
    assert again["privacy"]["epsilon"] == true == first["privacy"]["epsilon"]
    assert true != PLANTED_EPSILON
    (segment,) = hist
    for epoch in again["epochs"]:  # every epoch's epsilon, from the history up to that epoch
        so_far = [Segment(segment.noise_multiplier, segment.sample_rate, epoch["steps"])]
        assert epoch["epsilon_spent"] == epsilon_from_history(so_far, 1e-5, "prv"), epoch
    memo.clear_memory()


def test_a_resumed_run_refuses_a_planted_sigma_before_its_next_step(
    tiny_cfg, scratch_ckpt, tmp_path, monkeypatch
):
    """The resume state carries the algorithm's sigma; an edited one is verified like the memo's."""
    import torch

    from dpadapter.stages import finetune
    from dpadapter.train.resume import ResumeFile

    real = ResumeFile.save

    def save_then_die(self, obj):
        real(self, obj)
        raise KeyboardInterrupt("killed")

    monkeypatch.setattr(ResumeFile, "save", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        _finetune(tiny_cfg, scratch_ckpt, tmp_path / "killed")
    monkeypatch.setattr(ResumeFile, "save", real)
    w = {"upstream": "scratch", "task": "syn-shift", "algo": "dpsgd", "eps": "2", "seed": "0"}
    path = finetune.resume_path(tiny_cfg, w)
    state = torch.load(path, weights_only=False)
    state["algorithm"]["sigma"] = PLANTED_SIGMA
    torch.save(state, path)
    steps = []
    monkeypatch.setattr(
        "dpadapter.algorithms.base.DPAlgorithm.train_step", lambda *a: steps.append(1) or 0.0
    )
    with pytest.raises(CalibrationError, match="exceeds the target"):
        _finetune(tiny_cfg, scratch_ckpt, tmp_path / "resumed")
    assert not steps, "a step was taken with the planted sigma"
    memo.clear_memory()


FED = {
    "task": "syn-shift",
    "clients": 3,
    "min_client_size": 20,
    "rounds": 3,
    "seeds": [0],
    "ut_t1": "rule",
    "estimate_directions": 1,
    "gaussian": {"epsilons": [2.0], "max_grad_norm": 1.0, "lr": 0.5, "sample_rate": 0.5},
}


@pytest.mark.parametrize("with_rule", [False, True], ids=["constant", "joint-with-estimate"])
def test_federated_noise_plan_refuses_a_planted_sigma(tiny_raw, tiny_cfg, with_rule):
    from dpadapter.federated.stage import plan_noise

    cfg = from_dict({**tiny_raw, "federated": FED, "privacy": {"delta": 1e-5, "accountant": "rdp"}})
    sigma, _, _ = plan_noise(cfg, "gaussian", 2.0, 3, with_rule)
    assert sigma > PLANTED_SIGMA
    assert _plant(Path(cfg.results_dir) / ".cache", PLANTED_SIGMA, PLANTED_EPSILON)
    with pytest.raises(CalibrationError, match="exceeds the target"):
        plan_noise(cfg, "gaussian", 2.0, 3, with_rule)
    memo.clear_memory()
