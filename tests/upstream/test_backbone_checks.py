"""Backbone mistakes are refused by the validation, before any job, naming the config key:
a timm name timm does not have (with close matches), an input size the backbone cannot take,
a weights file whose keys or shapes do not fit (counts and the first names, not a hundred)."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
import yaml
from external_helpers import params_for, save_as, source_model
from test_external_validation import problems, with_external

from dpadapter.settings import ConfigError, read_raw
from dpadapter.validation.compose import validate, validate_files


@pytest.fixture
def vit_file(tmp_path):
    return save_as(source_model("vit"), tmp_path / "vit.pth", "state_dict")


def test_a_sound_external_backbone_passes(tiny_raw, vit_file, tmp_path):
    validate(with_external(tiny_raw, {"vit": params_for("vit", vit_file)}), check_files=True)
    st = save_as(source_model("resnet"), tmp_path / "r.safetensors", "safetensors")
    validate(with_external(tiny_raw, {"r": params_for("resnet", st)}), check_files=True)


def test_a_misspelled_timm_name_is_refused_with_close_matches(tiny_raw, vit_file):
    params = params_for("resnet", vit_file)
    params["model"] = "timm:resnet10_t"
    msg = problems(with_external(tiny_raw, {"r": params}))
    assert "pretrain.external.r.model: timm has no model 'resnet10_t'" in msg
    assert "timm:resnet10t" in msg
    raw = copy.deepcopy(tiny_raw)
    raw["model"] = {"name": "timm:vit_tiny_patch16_22"}
    assert "model.name: timm has no model 'vit_tiny_patch16_22'" in problems(raw)


def test_an_input_size_the_backbone_cannot_take_is_refused(tiny_raw, vit_file):
    params = params_for("vit", vit_file, input={"size": 28})  # the ViT is built at 32x32
    msg = problems(with_external(tiny_raw, {"vit": params}))
    assert "pretrain.external.vit.input.size:" in msg and "28x28" in msg


def _listing(msg: str) -> str:
    return Path(re.search(r"every key: (\S+\.log)\)", msg).group(1)).read_text()


def test_weights_that_do_not_fit_are_refused_briefly(tiny_raw, vit_file, capsys):
    params = params_for("vit", vit_file)
    params["timm_args"] = {**params["timm_args"], "depth": 2, "embed_dim": 48}
    msg = problems(with_external(tiny_raw, {"vit": params}))
    assert "pretrain.external.vit.weights:" in msg and "does not fit" in msg
    assert "missing from the file (blocks.1." in msg and "with other shapes" in msg
    assert len(msg.splitlines()) < 6 and len(msg) < 1500  # counts and first names only
    assert "  missing: blocks.1." in _listing(msg)  # the full list


def test_a_checkpoint_of_another_architecture_lists_its_keys_in_a_file_not_the_console(
    tiny_raw, tmp_path, capsys
):
    """Hundreds of key names on stderr buried the one-line refusal (issue 50)."""
    resnet = source_model("resnet")
    path = save_as(resnet, tmp_path / "resnet.pth", "state_dict")
    vit = source_model("vit")
    msg = problems(with_external(tiny_raw, {"vit": params_for("vit", path)}))
    err = capsys.readouterr().err
    assert "missing:" not in err and "not in the model:" not in err, err
    heads = "head."  # the ViT's classifier, left out; the ResNet's fc is just another key
    missing = [k for k in vit.state_dict() if not k.startswith(heads)]
    extra = [k for k in resnet.state_dict() if not k.startswith(heads)]
    assert f"{len(missing)} missing from the file ({', '.join(sorted(missing)[:3])}, … (+" in msg
    assert f"{len(extra)} not in the model (" in msg, msg
    assert len(msg.splitlines()) == 2 and len(msg) < 1000, msg
    listing = _listing(msg).splitlines()
    assert sorted(listing[1:]) == sorted(
        [f"  missing: {k}" for k in missing] + [f"  not in the model: {k}" for k in extra]
    )


def test_a_checkpoint_of_another_patch_size_names_the_shapes_and_timm_args(
    tiny_raw, vit_file, tmp_path, monkeypatch
):
    """An overlay's patch size against a checkpoint written in its base: the advice was to
    set or unset `weights` (required: no fix); the shapes come from timm_args (issue 50)."""
    monkeypatch.chdir(tmp_path)
    base = with_external(tiny_raw, {"vit": params_for("vit", vit_file)})
    Path("base.yaml").write_text(yaml.safe_dump(base))
    Path("top.yaml").write_text(
        "base: base.yaml\npretrain:\n  external:\n    vit:\n      timm_args:\n"
        "        patch_size: 4\n"
    )
    with pytest.raises(ConfigError) as info:
        validate_files(read_raw("top.yaml"), ["top.yaml"], check_files=True)
    msg = str(info.value)
    args = {**params_for("vit", vit_file)["timm_args"], "patch_size": 4}
    assert (
        f"  top.yaml:5: pretrain.external.vit.timm_args: {vit_file} was saved from another "
        "configuration of timm:vit_tiny_patch16_224: 2 keys with other shapes (pos_embed: "
        "(1, 17, 32) in the file, (1, 65, 32) in the model; patch_embed.proj.weight: "
        "(32, 3, 8, 8) in the file, (32, 3, 4, 4) in the model); the model's shapes come from "
        "pretrain.external.vit.model with pretrain.external.vit.timm_args "
        f"{json.dumps(dict(sorted(args.items())))}. Set them as the checkpoint was saved, or point "
        "pretrain.external.vit.weights at a checkpoint saved with these (every key: "
    ) in msg, msg
    assert "unset" not in msg and "set pretrain.external.vit.weights" not in msg, msg


def test_timm_args_a_model_sets_itself_are_refused_by_name(tiny_raw, tmp_path):
    """timm's crossvit_18_240 passes its own img_scale, embed_dim, ... and the caller's: Python's
    `got multiple values` named one argument of a timm internal; the refusal names the key and
    every argument to leave out, and a model that takes them builds."""
    args = {"img_size": 32, "img_scale": [1.0, 1.0], "embed_dim": [16, 32], "depth": [[1, 1, 0]]}
    weights = save_as(source_model("vit"), tmp_path / "cv.pth", "state_dict")
    params = {"model": "timm:crossvit_18_240", "weights": {"file": str(weights)}, "timm_args": args}
    msg = problems(with_external(tiny_raw, {"cv": params}))
    assert "pretrain.external.cv.timm_args: " in msg, msg
    assert "crossvit_18_240 sets img_scale, embed_dim, depth itself" in msg, msg
    assert "leave them out (img_size can stay)" in msg, msg
    import torch

    from dpadapter.models import create_model
    from dpadapter.settings import ModelConfig

    with torch.device("meta"):
        create_model(ModelConfig("timm:crossvit_9_240"), 10, 3, 0, timm_args=args)
        with pytest.raises(ValueError, match="crossvit_18_240 sets img_scale, embed_dim, depth"):
            create_model(ModelConfig("timm:crossvit_18_240"), 10, 3, 0, timm_args=args)


def test_a_job_checks_only_the_backbone_it_builds(
    tiny_raw, vit_file, tmp_path, monkeypatch, capsys
):
    """The workflow checks every backbone before any job; a pretrain job checks its own only, a
    fine-tuning job none (it rebuilds its backbone from the checkpoint's record): each meta build
    costs a job about 0.1 s of CPU, for every other upstream."""
    import json

    from dpadapter.launch import cli
    from dpadapter.upstream.checks import only_backbones

    bad = params_for("vit", vit_file, input={"size": 28})
    raw = with_external(tiny_raw, {"vit": params_for("vit", vit_file), "bad": bad})
    assert "pretrain.external.bad.input.size:" in problems(raw)
    with only_backbones(["vit"]):
        validate(raw, check_files=True)
        with only_backbones(None):
            assert "pretrain.external.bad.input.size:" in problems(raw)
    with only_backbones(["bad"]):
        assert "pretrain.external.bad.input.size:" in problems(raw)
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps(raw))
    ran = []
    monkeypatch.setattr(cli, "_dispatch", lambda args, c: ran.append(args.stage))
    ft = ["finetune", "--upstream", "bad", "--task", "syn-same", "--algo", "dpsgd", "--eps", "1"]
    ft += ["--seed", "0", "--ckpt", "m.pt", "--out", "o"]
    for argv, rc in ((["pretrain", "--method", "vit", "--out", "o"], 0), (ft, 0),
                     (["pretrain", "--method", "bad", "--out", "o"], 2)):  # fmt: skip
        assert cli.main(["--config", str(cfg), *argv]) == rc, capsys.readouterr().err
    assert ran == ["pretrain", "finetune"]
    assert "pretrain.external.bad.input.size:" in capsys.readouterr().err
