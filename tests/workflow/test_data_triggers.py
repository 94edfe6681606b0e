"""The data a job reads is part of its rerun trigger (dpadapter.workflow.fingerprint.data_part),
a changed dataset is said before the run (identity.data_changes), and a failed rerun gets the
previous outputs back (dpadapter.workflow.keep). The workflow-level runs are in
test_your_data_workflow.py."""

from __future__ import annotations

import copy

from tiny_config import TINY_RAW

from dpadapter.settings import from_dict
from dpadapter.workflow import keep
from dpadapter.workflow.fingerprint import data_part, stage_fingerprint
from dpadapter.workflow.identity import data_changes, record

MINE = "imagefolder:digits@16"


def _config() -> dict:
    raw = copy.deepcopy(TINY_RAW)
    raw["tasks"]["mine"] = {"dataset": MINE, "n_train": 10, "n_test": 4}
    raw["public"]["dataset"] = "fashion-mnist"
    return raw


DATA = {MINE: "m1", "fashion-mnist": "f1", "synthetic": None}
WC = {"upstream": "scratch", "task": "mine", "algo": "dpsgd", "eps": "1", "seed": "0"}


def test_a_job_reads_its_tasks_data_and_the_public_sets_while_it_normalises():
    raw = _config()
    assert (
        data_part(raw, "finetune", WC, DATA)
        == 'data{"fashion-mnist": "f1", "imagefolder:digits@16": "m1"}'
    )
    assert data_part(raw, "warmup", None, DATA) == 'data{"fashion-mnist": "f1"}'
    syn = {**WC, "task": "syn-same"}
    assert data_part(raw, "hpo", syn, DATA) == 'data{"fashion-mnist": "f1"}'  # synthetic: none
    raw["data"]["normalization"] = [[0.5], [0.5]]
    assert data_part(raw, "finetune", WC, DATA) == 'data{"imagefolder:digits@16": "m1"}'
    assert data_part(raw, "finetune", syn, DATA) == ""


def test_audit_and_federated_jobs_read_the_task_their_entry_points_pick():
    raw = _config()
    raw["data"]["normalization"] = [[0.5], [0.5]]
    raw["tasks"] = {"mine": raw["tasks"]["mine"], **raw["tasks"]}  # mine first
    assert "m1" in data_part(raw, "audit", {"algo": "dpsgd"}, DATA)
    raw["audit"] = {"task": "syn-same"}
    assert data_part(raw, "audit", {"algo": "dpsgd"}, DATA) == ""
    raw["federated"] = {"task": "mine"}
    assert "m1" in data_part(raw, "audit", {"algo": "federated-gaussian"}, DATA)
    assert "m1" in data_part(raw, "federated", {"upstream": "scratch"}, DATA)


def test_data_made_by_code_adds_nothing_to_a_trigger():
    raw = _config()
    edited = {**DATA, MINE: "m2"}
    v3 = [stage_fingerprint(raw, "finetune", WC, 3, None, d) for d in (DATA, edited)]
    assert v3[0] != v3[1] and v3[0].startswith(stage_fingerprint(raw, "finetune", WC, 3))
    syn = {**WC, "task": "syn-same"}
    raw["public"]["dataset"] = "synthetic"
    assert stage_fingerprint(raw, "finetune", syn, 3, None, DATA) == stage_fingerprint(
        raw, "finetune", syn, 3
    )


def test_a_folder_begun_before_data_triggers_keeps_them_off_its_finished_jobs(tmp_path):
    """A version 2 folder: the datasets of its last run stay out of the triggers (its finished
    jobs are not rerun by the upgrade); a dataset it sees first afterwards gets them, and
    keeps them on later runs."""
    import json

    from dpadapter.workflow.identity import IDENTITY_FILE, untriggered_data

    raw = _config()
    raw["results_dir"] = str(tmp_path / "res")
    del raw["tasks"]["mine"]
    old = from_dict(raw)
    record(old)
    path = tmp_path / "res" / IDENTITY_FILE
    stored = json.loads(path.read_text())
    stored["fingerprints"] = 2
    path.write_text(json.dumps(stored))
    assert untriggered_data(old) == {"fashion-mnist", "synthetic"}
    grown = from_dict(_config() | {"results_dir": raw["results_dir"]})
    assert untriggered_data(grown) == {"fashion-mnist", "synthetic"}  # mine: triggered
    record(grown)
    assert untriggered_data(grown) == {"fashion-mnist", "synthetic"}  # kept, mine not in it
    fresh = from_dict(_config() | {"results_dir": str(tmp_path / "new")})
    assert untriggered_data(fresh) == set()


def test_a_changed_dataset_is_said_against_the_last_run(tmp_path):
    raw = _config()
    raw["results_dir"] = str(tmp_path / "res")
    cfg = from_dict(raw)
    assert data_changes(cfg, DATA) is None  # nothing recorded
    record(cfg, DATA)
    assert data_changes(cfg, DATA) is None
    note = data_changes(cfg, {**DATA, MINE: "m2"})
    assert f"{MINE}: content m1 -> m2" in note and "fashion-mnist" not in note


def test_a_failed_jobs_previous_outputs_and_records_come_back(tmp_path):
    done, failed, new = (tmp_path / n for n in ("done", "failed", "new"))
    for d in (done, failed):
        d.mkdir()
        (d / "metrics.json").write_text(f"old {d.name}")
        (d / "model.pt").write_bytes(b"old weights")
    records = {str(failed / "metrics.json"): "rec-m", str(failed / "model.pt"): "rec-w"}
    jobs = [[str(done / "metrics.json"), str(done / "model.pt")],
            [str(failed / "metrics.json"), str(failed / "model.pt")],
            [str(new / "metrics.json")]]  # fmt: skip
    kept = keep.keep(tmp_path / "results", jobs, records.get)
    # what Snakemake does: both jobs' outputs removed; `done` rewrites its own, `failed` fails
    for d in (done, failed):
        for f in d.iterdir():
            f.unlink()
    (done / "metrics.json").write_text("new done")
    (done / "model.pt").write_bytes(b"new weights")
    put = {}
    restored = keep.restore(kept, put.__setitem__)
    assert sorted(restored) == sorted(jobs[1])
    assert (failed / "metrics.json").read_text() == "old failed"
    assert (failed / "model.pt").read_bytes() == b"old weights"
    assert (done / "metrics.json").read_text() == "new done"
    assert put == records
    assert not (tmp_path / "results" / keep.KEPT).exists()
    assert keep.keep(tmp_path / "results", [jobs[2]], records.get) is None
