"""A results folder built before fingerprint version 2 is carried over: its finished
fine-tuning jobs are not rerun when an upstream is added (the folder's triggers read the
upstream list its jobs were built with, dpadapter.workflow.identity.fingerprint_pins), while a
setting
they read still reruns them."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import snakemake_runner  # tests/ is on sys.path
import yaml

from dpadapter.settings import from_dict
from dpadapter.workflow.fingerprint import PINNED_UPSTREAMS
from dpadapter.workflow.identity import (
    IDENTITY_FILE,
    OVERWRITE_ENV,
    PINS_KEY,
    config_hash,
    fingerprint_pins,
    fingerprint_version,
    record,
    sections,
)

# Snakemake runs fork their jobs from the worker's fork servers (tests/conftest.py)
pytestmark = [pytest.mark.process, pytest.mark.usefixtures("module_fork_servers")]

REPO = Path(__file__).resolve().parents[2]


def _snakemake(wd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", OVERWRITE_ENV)}
    cmd = [sys.executable, "-m", "snakemake", "--snakefile", str(REPO / "Snakefile"),
           "--directory", str(wd), "--cores", "1", *args]  # fmt: skip
    return snakemake_runner.run(cmd, capture_output=True, text=True, env=env, timeout=600)


def _old_identity(raw: dict) -> dict:
    """config-identity.json as code before fingerprint versions wrote it (no version, no pins)."""
    cfg = from_dict(raw)
    return {"hash": config_hash(cfg), "written": "2026-01-01T00:00:00Z", "previous": [],
            "sections": sections(cfg)}  # fmt: skip


def _planned(r: subprocess.CompletedProcess) -> list[str]:
    assert r.returncode == 0, r.stderr[-3000:]
    return sorted(re.findall(r"output: (results/finetune/\S+/metrics\.json)", r.stdout + r.stderr))


def test_a_version_1_folder_runs_only_the_new_jobs_when_an_upstream_is_added(tiny_raw, tmp_path):
    wd = tmp_path
    tiny_raw["tasks"] = {"syn-same": tiny_raw["tasks"]["syn-same"]}
    tiny_raw["finetune"].update(upstreams=["scratch"], epsilons=[1], epochs=1)
    tiny_raw["tracking"] = {"enabled": False}
    (wd / "config.yaml").write_text(yaml.safe_dump(tiny_raw))
    results = wd / "results"
    results.mkdir()
    identity = results / IDENTITY_FILE
    identity.write_text(json.dumps(_old_identity(tiny_raw)))  # a folder of the old code
    done = "results/finetune/scratch/syn-same/dpsgd/eps1/seed0/metrics.json"
    assert _planned(_snakemake(wd, done)) == [done]
    stored = json.loads(identity.read_text())
    assert stored["fingerprints"] == 1 and stored[PINS_KEY] == {PINNED_UPSTREAMS: ["scratch"]}
    del stored[PINS_KEY], stored["fingerprints"]  # as the old code left it
    identity.write_text(json.dumps(stored))

    grown_raw = {
        **tiny_raw,
        "finetune": {**tiny_raw["finetune"], "upstreams": ["scratch", "standard"]},
    }
    (wd / "config.yaml").write_text(yaml.safe_dump(grown_raw))
    new = "results/finetune/standard/syn-same/dpsgd/eps1/seed0/metrics.json"
    out = _snakemake(wd, "-n", done, new)
    assert _planned(out) == [new]  # the finished job is carried over, not rerun
    assert "another config" not in out.stdout + out.stderr

    # a setting the finished job read still reruns it
    changed = {**grown_raw, "finetune": {**grown_raw["finetune"], "lr": 0.123}}
    (wd / "config.yaml").write_text(yaml.safe_dump(changed))
    assert _planned(_snakemake(wd, "-n", done, new)) == sorted([done, new])


def test_the_pinned_list_is_kept_when_the_grid_grows(tiny_raw, tmp_path):
    """The pin comes from the folder's last config once and stays: a later run with a grown
    list records its config, not a new pin; a new folder (version 2) has none."""
    tiny_raw["results_dir"] = str(tmp_path / "old")
    tiny_raw["finetune"]["upstreams"] = ["scratch"]
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / IDENTITY_FILE).write_text(json.dumps(_old_identity(tiny_raw)))
    grown = from_dict(
        {**tiny_raw, "finetune": {**tiny_raw["finetune"], "upstreams": ["scratch", "standard"]}}
    )
    assert fingerprint_version(grown) == 1
    assert fingerprint_pins(grown) == {PINNED_UPSTREAMS: ["scratch"]}
    record(grown)
    record(grown)
    stored = json.loads((tmp_path / "old" / IDENTITY_FILE).read_text())
    assert stored[PINS_KEY] == {PINNED_UPSTREAMS: ["scratch"]}
    assert stored["sections"]["finetune"]["upstreams"] == ["scratch", "standard"]
    # the key unset when the folder was built: pinned as unset
    del tiny_raw["finetune"]["upstreams"]
    (tmp_path / "old" / IDENTITY_FILE).write_text(json.dumps(_old_identity(tiny_raw)))
    assert fingerprint_pins(grown) == {}
    tiny_raw["results_dir"] = str(tmp_path / "new")
    assert fingerprint_pins(from_dict(tiny_raw)) is None
