"""Warm-up and pre-training loops (`sgd_train`) resume after an interruption to exactly the
weights of an uninterrupted run: per epoch, and within an epoch, for plain SGD and DPAdapter."""

from __future__ import annotations

import json

import pytest
import torch
from upstream.upstream_helpers import indexed_data, small_model  # noqa: E402

from dpadapter.settings import SGDConfig
from dpadapter.stages import pretrain, warmup
from dpadapter.train import progress as progress_mod
from dpadapter.train.loops import sgd_train, standard_step
from dpadapter.train.resume import ResumeFile, resume_file_path
from dpadapter.upstream import UPSTREAMS

# every job tracks into tmp_path/mlruns.db: made from a template, not migrated each time
pytestmark = pytest.mark.usefixtures("empty_mlflow_store")

N = 96
CFG = SGDConfig(
    epochs=3,
    batch_size=16,  # 6 steps an epoch
    lr=0.05,
    momentum=0.9,
    weight_decay=1e-4,
    milestones=(2,),  # after the epoch in which the run is killed: the scheduler must resume
    lr_gamma=0.5,
    max_steps=None,
)


class Killed(Exception):
    pass


def _dpadapter_step(data, seed=0):
    # refresh_every = 4 with 6 steps an epoch: a Delta computed in one epoch is reused in the
    # next, so the resumed run must restore it, the step count and the B1 generator.
    method = UPSTREAMS["dpadapter"](
        {"m1": 40, "m2": 16, "gamma": 0.5, "eta1": 1.0, "chunk_size": 16, "refresh_every": 4}
    )
    return method.make_step(data, seed)


def _kill_at(step_fn, at_step):
    calls = {"n": 0}

    def step(model, opt, x, y):
        calls["n"] += 1
        if calls["n"] == at_step:
            raise Killed
        return step_fn(model, opt, x, y)

    for attr in ("state_dict", "load_state_dict"):
        if hasattr(step_fn, attr):
            setattr(step, attr, getattr(step_fn, attr))
    return step


def _weights(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def _train(make_step, resume=None, save_every_s=1e9):
    data = indexed_data(N)
    model = small_model(seed=1)
    stats = sgd_train(
        model, data, CFG, seed=7, step=make_step(data), resume=resume, save_every_s=save_every_s
    )
    return _weights(model), stats


@pytest.mark.parametrize("kind", ["sgd", "dpadapter"])
@pytest.mark.parametrize("save_every_s", [1e9, 0.0], ids=["per-epoch", "every-step"])
def test_interrupted_loop_resumes_bit_identically(tmp_path, kind, save_every_s):
    base = (lambda d: standard_step) if kind == "sgd" else _dpadapter_step
    reference, ref_stats = _train(base)

    # Killed in the middle of epoch 2 (step 9 of 18).
    path = tmp_path / "state.pt"
    with pytest.raises(Killed):
        _train(lambda d: _kill_at(base(d), 9), ResumeFile(path, "id"), save_every_s)
    state = torch.load(path, weights_only=False)
    if save_every_s == 0:
        assert (state["epoch"], state["batch"], state["steps"]) == (1, 2, 8)
    else:
        assert (state["epoch"], state["batch"], state["steps"]) == (1, 0, 6)
    if kind == "dpadapter":
        assert state["step"]["last_delta"] is not None and state["step"]["sampler_rng"] is not None

    resumed, stats = _train(base, ResumeFile(path, "id"), save_every_s)
    assert stats == ref_stats  # the last epoch's loss, summed over batches before and after
    for k, v in reference.items():
        assert torch.equal(resumed[k], v), k


def test_state_of_another_configuration_is_ignored(tmp_path, capsys):
    path = tmp_path / "state.pt"
    with pytest.raises(Killed):
        _train(lambda d: _kill_at(standard_step, 9), ResumeFile(path, "config A"))
    assert ResumeFile(path, "config B").state is None
    assert "written for another configuration" in capsys.readouterr().err
    path.write_bytes(b"not a torch file")
    assert ResumeFile(path, "config A").state is None


def _fail_at_epoch(monkeypatch, label, epoch):
    """Stop a stage after it has finished `epoch - 1` epochs (as a kill would), once."""
    original = progress_mod.ProgressLine.epoch
    armed = {"on": True}

    def epoch_line(self, e, epochs, stats, **kw):
        if armed["on"] and self.label == label and e == epoch:
            armed["on"] = False
            raise Killed
        return original(self, e, epochs, stats, **kw)

    monkeypatch.setattr(progress_mod.ProgressLine, "epoch", epoch_line)


def _mlflow_runs(tmp_path):
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlruns.db'}")
    exp = client.get_experiment_by_name("tests")
    runs = client.search_runs([exp.experiment_id])
    return [r for r in runs if "stage" in r.data.tags]  # the jobs', not their group runs


def test_warmup_stage_resumes_after_a_kill(tiny_raw, tmp_path, monkeypatch):
    from dpadapter.settings import from_dict

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlruns.db'}")
    tiny_raw["warmup"]["epochs"] = 3
    tiny_raw["public"]["n_train"] = 300
    cfg = from_dict(tiny_raw)
    full = tmp_path / "full"
    warmup.run(cfg, full)

    out = tmp_path / "killed"
    _fail_at_epoch(monkeypatch, "warmup", 2)
    with pytest.raises(Killed):
        warmup.run(cfg, out)
    state = resume_file_path(cfg.results_dir, "warmup")
    assert state.exists() and not (out / "metrics.json").exists()
    m = warmup.run(cfg, out)
    assert m["resumed_from"] == {"epoch": 1, "batch": 0, "steps": 5}
    assert not state.exists(), "the resume state is removed once the job succeeds"
    a = torch.load(full / "model.pt", weights_only=True)["state_dict"]
    b = torch.load(out / "model.pt", weights_only=True)["state_dict"]
    assert all(torch.equal(a[k], b[k]) for k in a)
    ref = json.loads((full / "metrics.json").read_text())
    assert m["public_test_accuracy"] == ref["public_test_accuracy"]
    # the retry continued the killed job's MLflow run: two runs in all, both finished
    assert sorted(r.info.status for r in _mlflow_runs(tmp_path)) == ["FINISHED", "FINISHED"]


def test_dpadapter_pretraining_resumes_after_a_kill(tiny_raw, tmp_path, monkeypatch):
    from dpadapter.settings import from_dict

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlruns.db'}")
    tiny_raw["public"]["n_train"] = 300
    tiny_raw["pretrain"]["methods"] = ["scratch", "standard", "dpadapter"]
    tiny_raw["pretrain"]["params"] = {
        "dpadapter": {
            "epochs": 3,
            "m1": 100,
            "m2": 64,
            "gamma": 0.5,
            "lr": 0.01,
            "milestones": [2],
            "chunk_size": 50,
            "refresh_every": 3,
        }
    }
    cfg = from_dict(tiny_raw)
    warmup.run(cfg, tmp_path / "warmup")
    ckpt = tmp_path / "warmup" / "model.pt"
    pretrain.run(cfg, "dpadapter", tmp_path / "full", ckpt)

    out = tmp_path / "killed"
    _fail_at_epoch(monkeypatch, "dpadapter", 2)
    with pytest.raises(Killed):
        pretrain.run(cfg, "dpadapter", out, ckpt)
    state = resume_file_path(cfg.results_dir, "pretrain", "dpadapter")
    assert state.exists() and not (out / "metrics.json").exists()
    m = pretrain.run(cfg, "dpadapter", out, ckpt)
    assert m["resumed_from"] == {"epoch": 1, "batch": 0, "steps": 5}
    assert not state.exists()
    a = torch.load(tmp_path / "full" / "model.pt", weights_only=True)["state_dict"]
    b = torch.load(out / "model.pt", weights_only=True)["state_dict"]
    assert all(torch.equal(a[k], b[k]) for k in a)
