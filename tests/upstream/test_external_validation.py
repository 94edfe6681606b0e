"""External upstreams in a config: names, labels, data normalisation and weights on disk, all
refused at validation (before any job), each message naming the key and what to do."""

from __future__ import annotations

import copy

import pytest
import torch
from external_helpers import VIT, params_for, save_as, source_model

from dpadapter.settings import ConfigError
from dpadapter.upstream.resolve import method_class, weights_file
from dpadapter.validation.compose import validate
from dpadapter.workflow.fingerprint import stage_fingerprint

HUB_REPO = "timm/vit_tiny_patch16_224.augreg_in21k_ft_in1k"


def with_external(tiny_raw, external: dict, methods=None, identity=True) -> dict:
    raw = copy.deepcopy(tiny_raw)
    raw["pretrain"] = {"methods": methods or ["scratch", *external], "external": external}
    if identity:
        raw["data"]["normalization"] = {"mean": [0.0], "std": [1.0]}
    return raw


def problems(raw) -> str:
    with pytest.raises(ConfigError) as err:
        validate(raw, check_files=True)
    return str(err.value)


@pytest.fixture
def vit_file(tmp_path):
    return save_as(source_model("vit"), tmp_path / "vit.pth", "state_dict")


def test_a_label_is_an_upstream_name_everywhere(tiny_raw, vit_file):
    raw = with_external(tiny_raw, {"vit-s": params_for("vit", vit_file)})
    raw["finetune"]["upstreams"] = ["vit-s"]
    raw["hpo"] = {"upstreams": ["vit-s"]}
    raw["federated"] = {"upstreams": ["vit-s"]}
    cfg = validate(raw, check_files=True)
    assert method_class(cfg, "vit-s").name == "external"
    assert weights_file(cfg, "vit-s") == str(vit_file)
    assert weights_file(cfg, "scratch") is None
    assert ("vit-s", "syn-same", "dpsgd", 1.0, 0, "ft") in cfg.finetune_grid()
    # the pretrain job's rerun trigger covers the label's params (its file path among them)
    fp = stage_fingerprint(raw, "pretrain", {"upstream": "vit-s"})
    raw["pretrain"]["external"]["vit-s"]["input"] = {"size": 48}
    assert stage_fingerprint(raw, "pretrain", {"upstream": "vit-s"}) != fp


def test_single_backbone_as_pretrain_params_external(tiny_raw, vit_file):
    raw = copy.deepcopy(tiny_raw)
    raw["pretrain"] = {
        "methods": ["scratch", "external"],
        "params": {"external": params_for("vit", vit_file)},
    }
    raw["data"]["normalization"] = {"mean": [0.0], "std": [1.0]}
    cfg = validate(raw, check_files=True)
    assert weights_file(cfg, "external") == str(vit_file)
    raw["pretrain"]["params"] = {}
    assert "pretrain.params.external: 'model' is a required property" in problems(raw)


def test_labels_must_not_shadow_methods_and_must_be_built(tiny_raw, vit_file):
    raw = with_external(tiny_raw, {"standard": params_for("vit", vit_file)})
    assert "pretrain.external.standard: the label is a registered method's name" in problems(raw)
    raw = with_external(tiny_raw, {"vit": params_for("vit", vit_file)}, methods=["scratch"])
    assert "pretrain.external.vit: not in pretrain.methods" in problems(raw)
    raw = with_external(tiny_raw, {"vit": params_for("vit", vit_file)})
    raw["finetune"]["upstreams"] = ["vit-b"]
    assert "finetune.upstreams: 'vit-b' is not in pretrain.methods" in problems(raw)


def test_adapter_normalisation_needs_unnormalised_data(tiny_raw, vit_file):
    raw = with_external(tiny_raw, {"vit": params_for("vit", vit_file)}, identity=False)
    msg = problems(raw)
    assert "data.normalization: pretrain.external.vit normalises in its input adapter" in msg
    raw["pretrain"]["external"]["vit"]["input"] = {"normalization": "data"}
    validate(raw, check_files=True)  # the data pipeline normalises, the adapter does not


def test_missing_file_names_the_path(tiny_raw, tmp_path):
    gone = tmp_path / "nowhere" / "vit.safetensors"
    raw = with_external(tiny_raw, {"vit": params_for("vit", gone)})
    msg = problems(raw)
    assert f"pretrain.external.vit.weights: weights file {gone} not found" in msg
    assert f"dvc add {gone}" in msg
    validate(raw)  # a job's own validation does not look for files; the workflow's does


def test_offline_hub_names_the_repo_and_the_fetch_command(tiny_raw, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    ext = {"model": VIT[0], "weights": {"hub": True}, "timm_args": VIT[1]}
    msg = problems(with_external(tiny_raw, {"vit": ext}))
    assert (
        f"hub weights {HUB_REPO} are not in the Hugging Face cache {tmp_path / 'hf' / 'hub'}" in msg
    )
    assert (
        f'HF_HOME={tmp_path / "hf"} python -c "import timm; '
        "timm.create_model('vit_tiny_patch16_224', pretrained=True)\"" in msg
    )
    ext["weights"]["hub_id"] = "someone/my-vit"
    msg = problems(with_external(tiny_raw, {"vit": ext}))
    assert f"HF_HOME={tmp_path / 'hf'} huggingface-cli download someone/my-vit" in msg


def test_torchvision_weights_not_cached_name_the_enum(tiny_raw, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    ext = {"model": "timm:resnet18", "weights": {"torchvision": "ResNet18_Weights.IMAGENET1K_V1"}}
    msg = problems(with_external(tiny_raw, {"rn": ext}))
    assert "torchvision weights ResNet18_Weights.IMAGENET1K_V1 are not in" in msg
    assert "get_weight('ResNet18_Weights.IMAGENET1K_V1').get_state_dict()" in msg


def test_hub_cache_is_read_offline_through_timm(tiny_cfg, tmp_path, monkeypatch):
    """A hub cache laid out as huggingface_hub writes it: found, loaded by timm, hashed."""
    from external_helpers import build
    from safetensors.torch import save_file

    from dpadapter.upstream.external import External

    snap = tmp_path / "hf" / "hub" / f"models--{HUB_REPO.replace('/', '--')}"
    (snap / "refs").mkdir(parents=True)
    (snap / "refs" / "main").write_text("abc123")
    (snap / "snapshots" / "abc123").mkdir(parents=True)
    src = source_model("vit")
    save_file(dict(src.state_dict()), str(snap / "snapshots" / "abc123" / "model.safetensors"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    method, model, _ = build(
        tiny_cfg, {"model": VIT[0], "weights": {"hub": True}, "timm_args": VIT[1]}
    )
    assert isinstance(method, External)
    assert method.provenance()["source"] == f"hf-hub:{HUB_REPO}"
    got = model.backbone.state_dict()
    for k, v in src.state_dict().items():
        if not k.startswith("head."):
            assert torch.equal(got[k], v), k
