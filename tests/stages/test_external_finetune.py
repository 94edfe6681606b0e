"""DP fine-tuning on an external checkpoint, under every registered algorithm: the pretrain job
loads a ResNet with BatchNorm (frozen during DP) from a file, fine-tuning rebuilds that backbone
from the checkpoint (not `model:` of the config), and the reported epsilon is the accountant's
for the recorded history."""

from __future__ import annotations

import json

import pytest
import torch
from external_helpers import params_for, save_as, source_model

from dpadapter.algorithms import ALGORITHMS
from dpadapter.privacy import Segment, epsilon_from_history
from dpadapter.settings import from_dict
from dpadapter.stages import finetune, pretrain
from dpadapter.train.checkpoint import load_model

# every job tracks into tmp_path/mlruns.db: made from a template, not migrated each time
pytestmark = pytest.mark.usefixtures("empty_mlflow_store")

STATS = ("running_mean", "running_var", "num_batches_tracked")


@pytest.fixture(scope="module")
def external_run(tmp_path_factory):
    """Where the weights files and pretrain jobs live, made once for all tests of this module."""
    return tmp_path_factory.mktemp("external")


def _cfg(tiny_raw, root, which: str):
    path = root / f"{which}.pth"
    if not path.exists():
        save_as(source_model(which), path, "state_dict")
    external = {which: params_for(which, path)}
    if which == "resnet":  # the data's own 16x16: only channels and normalisation adapted
        external[which]["input"] = {"size": 16}
    tiny_raw["pretrain"] = {"methods": ["scratch", which], "external": external}
    tiny_raw["data"]["normalization"] = {"mean": [0.0], "std": [1.0]}
    tiny_raw["finetune"].update(epochs=1, grad_sample_mode="functorch")
    return from_dict(tiny_raw)


def _pretrained(cfg, root, which):
    out = root / f"pre-{which}"
    if not (out / "model.pt").exists():
        pretrain.run(cfg, which, out, None)
    return out / "model.pt"


@pytest.mark.slow  # in-process, too long for `make check`
@pytest.mark.parametrize("algo", sorted(ALGORITHMS))
def test_every_algorithm_fine_tunes_a_frozen_bn_resnet(
    algo, tiny_raw, external_run, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    cfg = _cfg(tiny_raw, external_run, "resnet")
    ckpt = _pretrained(cfg, external_run, "resnet")
    out = tmp_path / "ft"
    finetune.run(cfg, "resnet", "syn-shift", algo, 4.0, 0, ckpt, out)
    m = json.loads((out / "metrics.json").read_text())
    p = m["privacy"]
    hist = [Segment(**s) for s in p["history"]]
    assert p["steps"] == sum(s.steps for s in hist) == 8  # 400 examples, q = 50/400, 1 epoch
    assert p["epsilon"] == pytest.approx(
        epsilon_from_history(hist, p["delta"], p["accountant"]), rel=1e-9
    )
    assert 0 < p["epsilon"] <= 4.0
    # the fine-tuned checkpoint rebuilds the external backbone, BatchNorm statistics untouched
    before, _ = load_model(ckpt)
    after, meta = load_model(out / "model.pt")
    assert meta["model"]["name"] == "timm:resnet18" and meta["in_chans"] == 3
    sb, sa = before.state_dict(), after.state_dict()
    stats = [k for k in sb if k.rsplit(".", 1)[-1] in STATS]
    assert len(stats) == 3 * 13  # the stem, two per block and four downsamples
    assert all(torch.equal(sa[k], sb[k]) for k in stats)
    assert not torch.equal(sa["backbone.bn1.weight"], sb["backbone.bn1.weight"])  # affine trains


@pytest.mark.slow  # in-process, too long for `make check`
def test_a_vit_fine_tunes_too(tiny_raw, external_run, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = _cfg(tiny_raw, external_run, "vit")
    ckpt = _pretrained(cfg, external_run, "vit")
    metrics = finetune.run(cfg, "vit", "syn-shift", "dpsgd", 4.0, 0, ckpt, tmp_path / "ft")
    assert metrics["privacy"]["steps"] == 8 and 0.0 <= metrics["test_accuracy"] <= 1.0
    _, meta = load_model(tmp_path / "ft" / "model.pt")
    assert meta["model"]["timm_args"]["embed_dim"] == 32
