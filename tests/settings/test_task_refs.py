"""An overlay that replaces the default's tasks (`unset: [tasks]`, docs/your-data.md) takes the
base's mentions of them along: the merged config is valid in every section, so the main grid
runs and no run warns about sections it does not use."""

from pathlib import Path

import pytest
import yaml

from dpadapter.settings import read_raw
from dpadapter.settings.task_refs import drop_task_references
from dpadapter.validation.compose import validate

REPO = Path(__file__).resolve().parents[2]
MINE = {"dataset": "imagefolder:/nowhere/digits@28", "n_val": 100}


def _overlay(tmp_path, text: str) -> Path:
    p = tmp_path / "mine.yaml"
    p.write_text(f"base: {REPO / 'config.yaml'}\n" + text)
    return p


def test_the_guides_overlay_replaces_the_tasks_and_every_section_validates(tmp_path):
    raw = read_raw(_overlay(tmp_path, "unset: [tasks]\ntasks:\n  digits: " + str(MINE) + "\n"))
    assert list(raw["tasks"]) == ["digits"]
    assert "extra_grids" not in raw["finetune"] and "task" not in raw["audit"]
    assert "tasks" not in raw["hpo"] and "task" not in raw["federated"]
    assert "tasks" not in raw["sweeps"]
    validate(raw)  # every section, the optional ones too: nothing to warn about


def test_only_the_removed_tasks_go_and_the_overlays_own_keys_stay(tmp_path):
    text = yaml.safe_dump({"unset": ["tasks.fmnist-same"], "audit": {"task": "fmnist-shift"}})
    raw = read_raw(_overlay(tmp_path, text))
    assert raw["audit"]["task"] == "fmnist-shift" and raw["federated"]["task"] == "fmnist-shift"
    assert raw["finetune"]["extra_grids"][0]["tasks"] == ["fmnist-shift"]


@pytest.mark.parametrize(
    ("raw", "want"),
    [
        ({"hpo": {"tasks": ["a", "b"]}}, {"hpo": {"tasks": ["b"]}}),
        ({"hpo": {"tasks": ["a"]}}, {"hpo": {}}),
        (
            {"audit": {"task": "a"}, "federated": {"task": "b"}},
            {"audit": {}, "federated": {"task": "b"}},
        ),
        (
            {"finetune": {"extra_grids": [{"tasks": ["a"]}, {"tasks": ["a", "b"]}, {"tasks": []}]}},
            {"finetune": {"extra_grids": [{"tasks": ["b"]}, {"tasks": []}]}},
        ),
        ({"finetune": {"algo_params_for": [{"tasks": ["a"]}]}}, {"finetune": {}}),
        ({"reference": {"task": "a", "cells": []}}, {}),
        (
            {"reference": {"task": "b", "cells": [{"task": "a"}, {"task": None}]}},
            {"reference": {"task": "b", "cells": [{"task": None}]}},
        ),
    ],
)
def test_each_kind_of_mention(raw, want):
    assert drop_task_references(raw, {"a"}) == want
    assert drop_task_references(raw, set()) is raw
