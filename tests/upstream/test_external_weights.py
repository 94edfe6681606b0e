"""`external`: checkpoints the tests make come back through the method, identical but the head."""

from __future__ import annotations

import json

import pytest
import torch
from external_helpers import BACKBONES, build, params_for, save_as, source_model

from dpadapter.data import build_splits
from dpadapter.models.input_adapter import AdaptedModel
from dpadapter.stages import pretrain
from dpadapter.train.checkpoint import file_sha256, load_model
from dpadapter.upstream import UpstreamContext


@pytest.mark.parametrize(
    "which,form",
    [
        ("vit", "state_dict"),
        ("vit", "safetensors"),
        ("resnet", "timm_checkpoint"),
        ("resnet", "safetensors"),
    ],
)
def test_weights_come_back_identical_but_the_head(tiny_cfg, tmp_path, which, form):
    src = source_model(which)
    suffix = ".safetensors" if form == "safetensors" else ".pth"
    path = save_as(src, tmp_path / f"w{suffix}", form)
    method, model, ctx = build(tiny_cfg, params_for(which, path))
    assert isinstance(model, AdaptedModel)  # 1x16x16 synthetic data -> 3x32x32 backbone
    got, want = model.backbone.state_dict(), src.state_dict()
    head = "head." if which == "vit" else "fc."
    assert set(got) == set(want)
    for k in want:
        if k.startswith(head):
            assert got[k].shape[0] == 5 and want[k].shape[0] == 1000  # the public set's 5 classes
        else:
            assert torch.equal(got[k], want[k]), k
    prov = method.provenance()
    assert prov["sha256"] == file_sha256(path) and prov["source"] == str(path)
    assert prov["classifier_keys_dropped"] == [f"{head}bias", f"{head}weight"]
    record, in_chans = method.checkpoint_model(ctx)
    assert in_chans == 3 and record["name"] == BACKBONES[which][0]
    assert record["input"]["size"] == 32 and record["input"]["channels"] == 3


def test_pretrain_job_saves_a_checkpoint_that_rebuilds_its_own_backbone(
    tiny_raw, tmp_path, monkeypatch
):
    from dpadapter.settings import from_dict

    monkeypatch.chdir(tmp_path)

    src = source_model("resnet")
    path = save_as(src, tmp_path / "resnet.pth", "state_dict")
    tiny_raw["pretrain"] = {
        "methods": ["scratch", "rn"],
        "external": {"rn": params_for("resnet", path)},
    }
    tiny_raw["data"]["normalization"] = {"mean": [0.0], "std": [1.0]}
    cfg = from_dict(tiny_raw)
    metrics = pretrain.run(cfg, "rn", tmp_path / "pre", None)
    assert metrics["weights"]["sha256"] == file_sha256(path)
    assert "public_test_accuracy" not in metrics and "skipped" in metrics["public_report"]
    on_disk = json.loads((tmp_path / "pre" / "metrics.json").read_text())
    assert on_disk["weights"]["source"] == str(path)
    model, ckpt = load_model(tmp_path / "pre" / "model.pt")  # cfg.model is cnn-gn: not used
    assert ckpt["model"]["name"] == "timm:resnet18" and ckpt["model"]["batchnorm"] == "freeze"
    assert isinstance(model, AdaptedModel)
    for k, v in src.state_dict().items():
        if not k.startswith("fc."):
            assert torch.equal(model.backbone.state_dict()[k], v), k


def test_groupnorm_choice_drops_the_statistics(tiny_cfg, tmp_path):
    path = save_as(source_model("resnet"), tmp_path / "w.pth", "state_dict")
    method, model, _ = build(tiny_cfg, params_for("resnet", path, batchnorm="groupnorm"))
    kinds = {type(m).__name__ for m in model.modules()}
    assert "GroupNorm" in kinds and "BatchNorm2d" not in kinds
    assert method.checkpoint_model(_ctx(tiny_cfg))[0]["batchnorm"] == "groupnorm"


def _ctx(cfg):
    plan, _ = build_splits(cfg, ["public"])
    return UpstreamContext(cfg, plan, None, None, 0, lambda e, s: None)


def test_mismatched_weights_are_refused_by_name(tiny_cfg, tmp_path):
    state = source_model("resnet").state_dict()
    state["extra.weight"] = torch.zeros(2)
    del state["layer1.0.conv1.weight"]
    state["conv1.weight"] = torch.zeros(64, 3, 5, 5)
    path = tmp_path / "bad.pth"
    torch.save(state, path)
    with pytest.raises(ValueError) as err:
        build(tiny_cfg, params_for("resnet", path))
    msg = str(err.value)
    assert str(path) in msg
    assert "missing from the weights: layer1.0.conv1.weight" in msg
    assert "not in the model: extra.weight" in msg
    assert "conv1.weight: (64, 3, 5, 5) in the file, (64, 3, 7, 7) in the model" in msg
