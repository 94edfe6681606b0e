"""Both readings of a paper's batch size and fixed normalisation constants (issue 23, item 7).

The DP-SAT paper's code samples at q = 1 / len(DataLoader(batch_size=B)); the text's "batch
2048" also reads as q = B / n. Each reading must reach the accountant and the loop unchanged.
"""

import json
from pathlib import Path

import pytest
import torch

from dpadapter.data import build_splits
from dpadapter.data.tasks import SplitError
from dpadapter.privacy import Segment, epsilon_from_history
from dpadapter.settings import ConfigError, from_dict, load
from dpadapter.stages import finetune, pretrain
from dpadapter.train.dp_spec import run_spec, sample_rate

# every job tracks into tmp_path/mlruns.db: made from a template, not migrated each time
pytestmark = pytest.mark.usefixtures("empty_mlflow_store")

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("n", "b", "rule", "q", "steps"),
    [
        (48_000, 2048, "loader", 1 / 24, 24),  # the paper's code on the 0.8 split
        (60_000, 2048, "loader", 1 / 30, 30),  # ... on the official 60k split
        (48_000, 2048, "batch_size", 2048 / 48_000, 23),
        (400, 50, "loader", 1 / 8, 8),  # B divides n: both readings agree
        (400, 50, "batch_size", 50 / 400, 8),
    ],
)
def test_sample_rate_readings(tiny_raw, n, b, rule, q, steps):
    tiny_raw["finetune"].update(batch_size=b, sample_rate_from=rule)
    spec = run_spec(from_dict(tiny_raw), "dpsgd", 1.0, n)
    assert spec.sample_rate == pytest.approx(q, rel=1e-12)
    assert spec.steps_per_epoch == steps
    assert spec.expected_batch_size == round(n * q)


def test_unknown_reading_is_refused(tiny_raw):
    tiny_raw["finetune"]["sample_rate_from"] = "dataloader"
    with pytest.raises(ConfigError, match="sample_rate_from"):
        from_dict(tiny_raw)
    with pytest.raises(ValueError, match="sample_rate_from"):
        sample_rate(50, 400, "dataloader")


def test_table2_configs_use_the_papers_code_readings():
    for name in ("dpsat-table2.yaml", "dpsat-table2-dpnas.yaml"):
        cfg = load(REPO / "configs" / name)
        spec = run_spec(cfg, "dpsgd", 1.0, cfg.tasks["fmnist"].n_train)
        assert (spec.sample_rate, spec.steps_per_epoch, spec.total_steps) == (1 / 24, 24, 960)
        assert spec.expected_batch_size == 2000
        assert cfg.data.normalization == ((0.1307,), (0.3081,))


@pytest.mark.slow  # over ~1.5 s: make check's 2 minutes (docs/testing.md)
def test_loader_reading_reaches_the_loop_and_the_ledger(tiny_cfg, tmp_path):
    """q = 1/ceil(n/B) with B not dividing n: the releases and the recorded history use it."""
    import dataclasses

    ft = dataclasses.replace(tiny_cfg.finetune, batch_size=60, sample_rate_from="loader")
    cfg = dataclasses.replace(tiny_cfg, finetune=ft)
    pretrain.run(cfg, "scratch", tmp_path / "pre", None)
    finetune.run(
        cfg, "scratch", "syn-shift", "dpsgd", 2.0, 0, tmp_path / "pre" / "model.pt", tmp_path / "ft"
    )
    p = json.loads((tmp_path / "ft" / "metrics.json").read_text())["privacy"]
    hist = [Segment(**s) for s in p["history"]]
    assert all(s.sample_rate == 1 / 7 for s in hist)  # 400 examples, B = 60: 7 batches
    assert p["steps"] == 7 * cfg.finetune.epochs
    assert p["epsilon"] == pytest.approx(epsilon_from_history(hist, p["delta"], p["accountant"]))


def test_fixed_normalisation_constants(tiny_raw, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    derived, data = build_splits(from_dict(tiny_raw), ["syn-shift"])
    tiny_raw["data"]["normalization"] = {"mean": [0.25], "std": [0.5]}
    plan, fixed = build_splits(from_dict(tiny_raw), ["syn-shift"])
    assert plan.mean.tolist() == [0.25] and plan.std.tolist() == [0.5]
    # the same raw images, normalised with the other constants
    raw = data["syn-shift"].train.tensors[0] * derived.std + derived.mean
    expect = (raw - 0.25) / 0.5
    assert torch.allclose(fixed["syn-shift"].train.tensors[0], expect, atol=1e-5)


def test_bad_normalisation_constants_are_clear_errors(tiny_raw, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tiny_raw["data"]["normalization"] = {"mean": [0.1, 0.2], "std": [0.3]}
    with pytest.raises(ConfigError, match="2 mean"):
        from_dict(tiny_raw)
    tiny_raw["data"]["normalization"] = {"mean": [0.1, 0.2], "std": [0.3, 0.3]}
    with pytest.raises(SplitError, match="2 channel"):
        build_splits(from_dict(tiny_raw), ["public"])
    tiny_raw["data"]["normalization"] = {"mean": [0.1], "std": [0.0]}
    with pytest.raises(ConfigError, match="normalization"):
        from_dict(tiny_raw)
