"""A rerun job's MLflow run is told apart from the one it replaces (issue 36, item 8).

Snakemake reruns a job in place (`--forcerun`, a changed input, a retried failure); MLflow
showed two runs under one name and nothing said which result is on disk. The end-to-end check
is in tests/workflow/test_external_only.py; here the rule itself, on the store of the test.
"""

from __future__ import annotations

import pytest

from dpadapter import tracking
from dpadapter.workflow import reruns

pytestmark = pytest.mark.usefixtures("empty_mlflow_store")
WILDCARDS = {"upstream": "vit", "task": "t", "algo": "dpsgd", "eps": "1", "seed": "0"}


def _attempt(cfg, wildcards=WILDCARDS, fail=False):
    job = tracking.job(cfg, "finetune", wildcards)
    try:
        with tracking.start_run(
            cfg.tracking, job.name, job.tags, results_dir=cfg.results_dir,
            parent=(job.group, job.group_name),
        ) as run:  # fmt: skip
            if fail:
                raise RuntimeError("the job failed")
            return run.run_id
    except RuntimeError:
        return None


def _runs(cfg, tmp_path):
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlruns.db'}")
    exp = client.get_experiment_by_name(cfg.tracking.experiment)
    return client.search_runs(
        [exp.experiment_id], "tags.stage = 'finetune'", order_by=["attributes.start_time ASC"]
    )


def test_each_attempt_is_numbered_and_each_replaced_run_is_marked(tiny_cfg, tmp_path):
    first = _attempt(tiny_cfg)
    _attempt(tiny_cfg, fail=True)  # a failed attempt is replaced too
    third = _attempt(tiny_cfg)
    other = _attempt(tiny_cfg, {**WILDCARDS, "seed": "1"})  # another job: not an attempt
    runs = _runs(tiny_cfg, tmp_path)
    name = "finetune dpsgd vit t ε=1 s0"
    assert [(r.info.run_name, r.info.status) for r in runs] == [
        (f"{name} (replaced)", "FINISHED"),
        (f"{name} #2 (replaced)", "FAILED"),
        (f"{name} #3", "FINISHED"),
        ("finetune dpsgd vit t ε=1 s1", "FINISHED"),
    ]
    one, two, three, four = (r.data.tags for r in runs)
    assert one[reruns.REPLACED_BY_TAG] == runs[1].info.run_id
    assert two[reruns.REPLACES_TAG] == first and two[reruns.ATTEMPT_TAG] == "2"
    assert two[reruns.REPLACED_BY_TAG] == third
    assert three[reruns.ATTEMPT_TAG] == "3" and reruns.REPLACED_BY_TAG not in three
    assert reruns.ATTEMPT_TAG not in four and runs[3].info.run_id == other
    # the slot is where the result lives: the same for every attempt, whatever the config
    assert one[reruns.SLOT_TAG] == three[reruns.SLOT_TAG] != four[reruns.SLOT_TAG]
    assert one[reruns.SLOT_TAG].startswith(str((tmp_path / "results").resolve()))
