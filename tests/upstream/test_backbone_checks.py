"""Backbone mistakes are refused by the validation, before any job, naming the config key:
a timm name timm does not have (with close matches), an input size the backbone cannot take,
a weights file whose keys or shapes do not fit (counts and the first names, not a hundred)."""

from __future__ import annotations

import copy

import pytest
from external_helpers import params_for, save_as, source_model
from test_external_validation import problems, with_external

from dpadapter.validation import validate


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


def test_weights_that_do_not_fit_are_refused_briefly(tiny_raw, vit_file, capsys):
    params = params_for("vit", vit_file)
    params["timm_args"] = {**params["timm_args"], "depth": 2, "embed_dim": 48}
    msg = problems(with_external(tiny_raw, {"vit": params}))
    assert "pretrain.external.vit.weights:" in msg and "does not fit" in msg
    assert "missing from the file (blocks.1." in msg and "with other shapes" in msg
    assert len(msg.splitlines()) < 6 and len(msg) < 1500  # counts and first names only
    assert "  missing: blocks.1." in capsys.readouterr().err  # the full list
