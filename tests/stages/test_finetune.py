"""The fine-tuning stage end to end on tiny data: metrics.json, accounting, resume."""

import json
from pathlib import Path

import pytest
import torch

from dpadapter.privacy import Segment, epsilon_from_history, pld_epsilon
from dpadapter.stages import finetune, pretrain
from dpadapter.train.resume import ResumeFile


@pytest.fixture
def scratch_ckpt(tiny_cfg, tmp_path):
    pretrain.run(tiny_cfg, "scratch", tmp_path / "pre", None)
    return tmp_path / "pre" / "model.pt"


def _run(cfg, ckpt, out, eps=2.0, seed=0):
    return finetune.run(cfg, "scratch", "syn-shift", "dpsgd", eps, seed, ckpt, out)


@pytest.mark.slow  # in-process, too long for `make check`
def test_metrics_json_privacy_block_is_recomputable(tiny_cfg, scratch_ckpt, tmp_path):
    _run(tiny_cfg, scratch_ckpt, tmp_path / "ft")
    m = json.loads((tmp_path / "ft" / "metrics.json").read_text())
    p = m["privacy"]
    assert p["mechanism"] == "gaussian" and p["sampling"] == "poisson"
    assert p["target_epsilon"] == 2.0 and p["delta"] == 1e-5
    hist = [Segment(**s) for s in p["history"]]
    q = tiny_cfg.finetune.batch_size / 400
    assert sum(s.steps for s in hist) == p["steps"] == tiny_cfg.finetune.epochs * int(1 / q)
    assert all(s.sample_rate == q for s in hist)
    # the reported epsilon is exactly what the accountant gives for the recorded history ...
    assert p["epsilon"] == pytest.approx(
        epsilon_from_history(hist, p["delta"], p["accountant"]), rel=1e-9
    )
    # ... an upper bound close to an independent PLD recomputation, and within the target
    pld = pld_epsilon(hist, p["delta"])
    assert pld <= p["epsilon"] <= 1.02 * pld
    assert p["epsilon"] <= p["target_epsilon"]
    assert 0.0 <= m["test_accuracy"] <= 1.0 and 0.0 <= m["test_robust_accuracy"] <= 1.0
    assert [e["epoch"] for e in m["epochs"]] == list(range(1, tiny_cfg.finetune.epochs + 1))
    assert m["epochs"][-1]["epsilon_spent"] == pytest.approx(p["epsilon"])
    assert m["hyperparameters"]["noise_multiplier"] == hist[0].noise_multiplier


@pytest.mark.slow  # in-process, too long for `make check`
def test_runs_are_reproducible_and_seed_dependent(tiny_cfg, scratch_ckpt, tmp_path):
    a = _run(tiny_cfg, scratch_ckpt, tmp_path / "a")
    b = _run(tiny_cfg, scratch_ckpt, tmp_path / "b")
    _run(tiny_cfg, scratch_ckpt, tmp_path / "c", seed=1)
    wa, wb, wc = (torch.load(tmp_path / d / "model.pt")["state_dict"] for d in "abc")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert not all(torch.equal(wa[k], wc[k]) for k in wa)
    assert a["test_accuracy"] == b["test_accuracy"]


@pytest.mark.slow  # in-process, too long for `make check`
def test_interrupted_run_resumes_to_the_same_result(tiny_cfg, scratch_ckpt, tmp_path, monkeypatch):
    full = _run(tiny_cfg, scratch_ckpt, tmp_path / "full")
    w_full = torch.load(tmp_path / "full" / "model.pt")["state_dict"]

    # Kill the job right after the first epoch's state is written (as SIGKILL would).
    real = ResumeFile.save
    calls = {"n": 0}

    def save_then_die(self, obj):
        real(self, obj)
        calls["n"] += 1
        raise KeyboardInterrupt("killed")

    monkeypatch.setattr(ResumeFile, "save", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        _run(tiny_cfg, scratch_ckpt, tmp_path / "resumed")
    assert calls["n"] == 1 and not (tmp_path / "resumed" / "metrics.json").exists()
    state = finetune.resume_path(
        tiny_cfg,
        {"upstream": "scratch", "task": "syn-shift", "algo": "dpsgd", "eps": "2", "seed": "0"},
    )
    assert state.is_file()
    monkeypatch.setattr(ResumeFile, "save", real)

    resumed = _run(tiny_cfg, scratch_ckpt, tmp_path / "resumed")
    assert resumed["resumed_from_epoch"] == 1
    assert resumed["privacy"]["steps"] == full["privacy"]["steps"]
    assert resumed["privacy"]["epsilon"] == pytest.approx(full["privacy"]["epsilon"], rel=1e-12)
    assert resumed["privacy"]["history"] == full["privacy"]["history"]
    w_res = torch.load(tmp_path / "resumed" / "model.pt")["state_dict"]
    assert all(torch.allclose(w_full[k], w_res[k], atol=1e-6) for k in w_full)
    assert not state.exists(), "resume state is removed once the job succeeds"


def test_bad_inputs_fail_before_training(tiny_cfg, scratch_ckpt, tmp_path):
    with pytest.raises(KeyError, match="unknown task"):
        finetune.run(tiny_cfg, "scratch", "nope", "dpsgd", 1.0, 0, scratch_ckpt, tmp_path / "x")
    with pytest.raises(FileNotFoundError, match="checkpoint not found"):
        finetune.run(
            tiny_cfg, "scratch", "syn-shift", "dpsgd", 1.0, 0, Path("missing.pt"), tmp_path / "x"
        )
    with pytest.raises(ValueError, match="epsilon"):
        finetune.run(
            tiny_cfg, "scratch", "syn-shift", "dpsgd", float("inf"), 0, scratch_ckpt, tmp_path / "x"
        )


@pytest.mark.slow  # in-process, too long for `make check`
@pytest.mark.parametrize("algo", ["adpclip", "gep"])
def test_bookkeeping_mode_runs_the_stage_and_records_what_ran(
    tiny_cfg, scratch_ckpt, tmp_path, algo
):
    """`grad_sample_mode: bk` end to end (virtual batches through Opacus' BatchMemoryManager):
    the same run as hooks mode to float tolerance, and metrics.json says which mode ran."""
    from dataclasses import replace

    out = {}
    for mode in ("hooks", "bk"):
        cfg = replace(
            tiny_cfg,
            finetune=replace(tiny_cfg.finetune, grad_sample_mode=mode, physical_batch_size=7),
        )
        finetune.run(cfg, "scratch", "syn-shift", algo, 2.0, 0, scratch_ckpt, tmp_path / mode)
        out[mode] = json.loads((tmp_path / mode / "metrics.json").read_text())
    hp = out["bk"]["hyperparameters"]
    assert hp["grad_sample_mode"] == "bk"
    assert hp["grad_sample_mode_run"] == ("hooks" if algo == "gep" else "bk")
    plan = out["bk"]["clipping_plan"]
    assert (plan is None) == (algo == "gep")
    if plan:
        assert set(plan.values()) <= {"exact", "ghost", "per-example", "per-example-im2col"}
        assert "head" in plan
    assert out["bk"]["privacy"]["history"] == out["hooks"]["privacy"]["history"]
    assert out["bk"]["test_accuracy"] == pytest.approx(out["hooks"]["test_accuracy"], abs=0.02)
    a = torch.load(tmp_path / "hooks" / "model.pt", weights_only=True)["state_dict"]
    b = torch.load(tmp_path / "bk" / "model.pt", weights_only=True)["state_dict"]
    for k in a:
        assert torch.allclose(a[k].float(), b[k].float(), rtol=1e-4, atol=1e-5), k


@pytest.mark.parametrize("strategy", ["ft", "ut", "bitfit"])
def test_metrics_json_records_each_phase_and_its_released_dim(
    tiny_cfg, scratch_ckpt, tmp_path, strategy
):
    """What each phase released; BiTFiT moves the backbone's biases and nothing else of it."""
    from dataclasses import replace

    from dpadapter.models import create_model, replace_head
    from dpadapter.train.strategies import released_dim

    cfg = replace(
        tiny_cfg,
        finetune=replace(tiny_cfg.finetune, strategy=strategy, ut_t1_fraction=0.5, epochs=1),
    )
    m = _run(cfg, scratch_ckpt, tmp_path / strategy)
    steps = m["privacy"]["steps"]
    model = create_model(cfg.model, 5, 1, seed=0)
    replace_head(model, 5, 0)
    first = {"ft": "ft", "ut": "ht", "bitfit": "bitfit"}[strategy]
    phases = m["privacy"]["phases"]
    assert phases[0]["phase"] == first and phases[0]["start"] == 0
    assert sum(ph["steps"] for ph in phases) == steps
    assert [ph["phase"] for ph in phases] == (["ht", "ft"] if strategy == "ut" else [first])
    for ph in phases:
        assert ph["released_dim"] == released_dim(model, ph["phase"])
    assert m["hyperparameters"]["strategy"] == strategy
    if strategy == "bitfit":
        pre = torch.load(scratch_ckpt)["state_dict"]
        post = torch.load(tmp_path / strategy / "model.pt")["state_dict"]
        moved = {k for k in pre if not k.startswith("head") and not torch.equal(pre[k], post[k])}
        assert moved == {k for k in pre if k.endswith(".bias") and not k.startswith("head")}


@pytest.mark.parametrize("check", [True, False])
def test_a_switched_off_self_test_is_said_in_metrics_and_mlflow(
    tiny_cfg, scratch_ckpt, tmp_path, check
):
    import dataclasses

    from mlflow import MlflowClient

    cfg = dataclasses.replace(
        tiny_cfg, finetune=dataclasses.replace(tiny_cfg.finetune, per_sample_check=check)
    )
    _run(cfg, scratch_ckpt, tmp_path / "ft")
    m = json.loads((tmp_path / "ft" / "metrics.json").read_text())
    rec = m["per_sample_check"]
    assert rec["passed"] is (True if check else None)
    assert ("unverified" in rec["note"]) if not check else rec.get("verified", True)
    # the two checks timed apart (on a GPU they took 50 s of a Table 2 cell, docs/gpu.md)
    timed = m["timing_s"]
    assert timed["independence_check"] >= 0 and ("self_test" in timed) is check, timed
    runs = MlflowClient().search_runs(
        [e.experiment_id for e in MlflowClient().search_experiments()],
        filter_string="tags.stage = 'finetune'",
    )
    want = "verified" if check else "unverified"
    assert [r.data.tags["dp.per_example_clipping"] for r in runs] == [want]


@pytest.mark.parametrize("accountant", ["prv", "rdp"])
def test_rdp_order_warnings_reach_the_log_of_an_rdp_job_only(
    tiny_cfg, scratch_ckpt, tmp_path, accountant
):
    """A PRV job's log began with Opacus' RDP "optimal order" advice, from the bound PRV sizes
    its domain with (issue 50); an RDP job's calibration still hears it."""
    import dataclasses
    import warnings

    cfg = dataclasses.replace(
        tiny_cfg, privacy=dataclasses.replace(tiny_cfg.privacy, accountant=accountant)
    )
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _run(cfg, scratch_ckpt, tmp_path / "ft")
    order = [w for w in seen if "Optimal order is the" in str(w.message)]
    assert (len(order) > 0) is (accountant == "rdp")


@pytest.mark.slow  # in-process, too long for `make check`
def test_a_compiled_job_records_it_and_trains_as_the_eager_one(
    tiny_cfg, scratch_ckpt, tmp_path, monkeypatch
):
    """`finetune.compile` through the stage, with UT's two phases (head, then every
    parameter: two plans): metrics.json says it compiled; the ledger and the weights are the
    eager job's (Dynamo's `aot_eager` backend here, the traced graphs without inductor's C++
    compilation; tests/per_sample/test_compiled.py checks inductor's kernels)."""
    from dataclasses import replace

    real, compiled = torch.compile, []

    def compile_(module, **kw):
        # the forward with the job's mode; bk's rule phases with inductor's options for it,
        # CUDA graphs off (per_sample.compiled.rules_compile_kwargs), never a mode
        options = kw.pop("options", None)
        compiled.append(
            kw.get("mode") or ("rules" if options == {"triton.cudagraphs": False} else options)
        )
        return real(module, **{**kw, "backend": "aot_eager"})

    monkeypatch.setattr("dpadapter.per_sample.compiled.torch.compile", compile_)
    out = {}
    for mode in ("off", "default"):
        assert compiled == []  # the eager job compiled nothing
        ft = replace(tiny_cfg.finetune, compile=mode, strategy="ut", pad_batches=True)
        cfg = replace(tiny_cfg, finetune=ft)
        finetune.run(cfg, "scratch", "syn-shift", "dpsgd", 2.0, 0, scratch_ckpt, tmp_path / mode)
        out[mode] = json.loads((tmp_path / mode / "metrics.json").read_text())
    # the self-test's wraps and the job's: the forward in the job's mode, the rules without graphs
    assert compiled and set(compiled) == {"default", "rules"}
    assert out["default"]["hyperparameters"]["compile"] == "default"
    assert out["off"]["hyperparameters"]["compile"] == "off"
    assert out["default"]["per_sample_check"]["passed"] is True
    assert out["default"]["privacy"] == out["off"]["privacy"]
    a = torch.load(tmp_path / "off" / "model.pt", weights_only=True)["state_dict"]
    b = torch.load(tmp_path / "default" / "model.pt", weights_only=True)["state_dict"]
    for k in a:
        assert torch.allclose(a[k].float(), b[k].float(), rtol=1e-4, atol=1e-5), k


@pytest.mark.slow  # over ~1.5 s: make check's 2 minutes (docs/testing.md)
def test_an_algorithms_recipe_is_what_its_jobs_train_with(tiny_raw, scratch_ckpt, tmp_path):
    """`finetune.recipes.<algo>` replaces the shared recipe for that algorithm's jobs only: the
    steps, batch and clip reach the accountant, the lr the optimizer (and metrics.json)."""
    from dpadapter.settings import from_dict

    tiny_raw["finetune"]["recipes"] = {"adpalloc": {"lr": 0.2, "batch_size": 100, "epochs": 1}}
    cfg = from_dict(tiny_raw)
    own = finetune.run(
        cfg, "scratch", "syn-shift", "adpalloc", 2.0, 0, scratch_ckpt, tmp_path / "a"
    )
    shared = _run(cfg, scratch_ckpt, tmp_path / "s")
    assert (own["hyperparameters"]["lr"], own["hyperparameters"]["epochs"]) == (0.2, 1)
    assert own["privacy"]["steps"] == 400 // 100 and own["privacy"]["sample_rate"] == 0.25
    ft = tiny_raw["finetune"]
    assert (shared["hyperparameters"]["lr"], shared["hyperparameters"]["epochs"]) == (
        ft["lr"],
        ft["epochs"],
    )


def test_a_recipe_for_an_unknown_algorithm_or_key_is_refused(tiny_raw):
    from dpadapter.settings import ConfigError
    from dpadapter.validation.compose import validate

    tiny_raw["finetune"]["recipes"] = {"adpclip": {"lr": 0.2}}
    assert validate(tiny_raw).finetune.for_algorithm("adpclip").lr == 0.2
    tiny_raw["finetune"]["recipes"] = {"adpclipp": {"lr": 0.2}}
    with pytest.raises(ConfigError, match="finetune.recipes.adpclipp: unknown algorithm"):
        validate(tiny_raw)
    tiny_raw["finetune"]["recipes"] = {"adpclip": {"learning_rate": 0.2}}
    with pytest.raises(ConfigError, match="learning_rate"):
        validate(tiny_raw)


def test_adpclips_clip_course_is_logged_per_epoch(tiny_cfg, scratch_ckpt, tmp_path):
    """C_t after each epoch (post-processing of its noisy counts) in metrics.json: what
    docs/validity.md reads AdpClip's cells with; algorithms that adapt nothing log nothing."""
    m = finetune.run(
        tiny_cfg, "scratch", "syn-shift", "adpclip", 2.0, 0, scratch_ckpt, tmp_path / "a"
    )
    clips = [e["clip"] for e in m["epochs"]]
    assert len(clips) == tiny_cfg.finetune.epochs and all(c > 0 for c in clips)
    assert clips[-1] != tiny_cfg.finetune.max_grad_norm  # it moved from C_0
    assert "clip" not in _run(tiny_cfg, scratch_ckpt, tmp_path / "d")["epochs"][0]
