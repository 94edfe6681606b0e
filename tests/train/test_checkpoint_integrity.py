"""A corrupt or truncated checkpoint is detected on load, with the file and how to rebuild it."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from dpadapter.models import create_model
from dpadapter.settings import ModelConfig
from dpadapter.stages import pretrain, warmup
from dpadapter.train.checkpoint import CheckpointError, load_model, save_model

CFG = ModelConfig(name="cnn-gn", groups=4, width=8)


def _write(tmp_path, stage="pretrain"):
    """A checkpoint and its metrics.json as a stage writes them."""
    path = tmp_path / "model.pt"
    record = save_model(path, create_model(CFG, 3, 1, seed=0), CFG, 3, 1, {"upstream": "x"})
    (tmp_path / "metrics.json").write_text(json.dumps({"stage": stage, "checkpoint": record}))
    return path, record


def test_record_is_the_hash_of_the_written_bytes(tmp_path):
    path, record = _write(tmp_path)
    data = path.read_bytes()
    assert record == {
        "file": "model.pt",
        "sha256": hashlib.sha256(data).hexdigest(),
        "bytes": len(data),
    }
    model, ckpt = load_model(path)
    ref = create_model(CFG, 3, 1, seed=0).state_dict()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in ref.items())


def test_truncated_checkpoint_names_file_and_rebuild_command(tmp_path):
    path, _ = _write(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError) as err:
        load_model(path)
    msg = str(err.value)
    assert str(path) in msg and "corrupt or truncated" in msg
    assert f"snakemake --cores all --force {path}" in msg and "rule `pretrain`" in msg


def test_flipped_byte_that_torch_would_load_is_caught_by_the_hash(tmp_path):
    """A bit flip inside a weight does not break the zip archive: only the hash sees it."""
    path, _ = _write(tmp_path)
    data = bytearray(path.read_bytes())
    # flip a byte in the middle of the largest stored tensor's data (not in a zip header)
    ckpt = torch.load(path, weights_only=True)
    big = max(ckpt["state_dict"].values(), key=lambda t: t.numel())
    raw = big.numpy().tobytes()
    at = bytes(data).find(raw) + len(raw) // 2
    assert at > len(raw) // 2
    data[at] ^= 0x01
    path.write_bytes(bytes(data))
    torch.load(path, weights_only=True)  # still loads: the damage would pass silently
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        load_model(path)


def test_unreadable_checkpoint_without_record_is_a_clear_error(tmp_path):
    """No metrics.json beside it (written outside a stage): torch's error becomes ours."""
    path = tmp_path / "model.pt"
    save_model(path, create_model(CFG, 3, 1, seed=0), CFG, 3, 1, {})
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(CheckpointError) as err:
        load_model(path)
    assert str(path) in str(err.value) and "snakemake --cores all --force" in str(err.value)
    assert not isinstance(err.value, OSError)


def test_stages_record_the_hash_and_a_truncated_warmup_stops_pretraining(tiny_cfg, tmp_path):
    out = tmp_path / "warmup"
    m = warmup.run(tiny_cfg, out)
    ckpt = out / "model.pt"
    on_disk = json.loads((out / "metrics.json").read_text())["checkpoint"]
    assert m["checkpoint"] == on_disk
    assert on_disk["sha256"] == hashlib.sha256(ckpt.read_bytes()).hexdigest()
    pretrain.run(tiny_cfg, "standard", tmp_path / "standard", ckpt)  # intact: loads

    ckpt.write_bytes(ckpt.read_bytes()[:-10])
    with pytest.raises(CheckpointError) as err:
        pretrain.run(tiny_cfg, "standard", tmp_path / "standard2", ckpt)
    assert "rule `warmup`" in str(err.value) and str(ckpt) in str(err.value)
    assert not (tmp_path / "standard2" / "metrics.json").exists()
