"""The real Fashion-MNIST loader path (Debian files -> torchvision) on small files made here."""

import gzip
import struct

import numpy as np
import pytest

from dpadapter.data import DatasetUnavailable, load_dataset
from dpadapter.data.sources import prepare_fashion_mnist


def _write_idx(path, arr: np.ndarray) -> None:
    magic = 0x0803 if arr.ndim == 3 else 0x0801
    header = struct.pack(">I", magic) + b"".join(struct.pack(">I", d) for d in arr.shape)
    with gzip.open(path, "wb") as fh:
        fh.write(header + arr.astype(np.uint8).tobytes())


@pytest.fixture
def fake_debian(tmp_path):
    d = tmp_path / "debian"
    d.mkdir()
    rng = np.random.default_rng(0)
    for prefix, n in (("train", 30), ("t10k", 12)):
        _write_idx(d / f"{prefix}-images-idx3-ubyte.gz", rng.integers(0, 256, (n, 28, 28)))
        _write_idx(d / f"{prefix}-labels-idx1-ubyte.gz", np.arange(n) % 10)
    return d


def test_debian_files_are_unpacked_where_torchvision_reads_them(tmp_path, fake_debian, monkeypatch):
    root = tmp_path / "data"
    raw = prepare_fashion_mnist(root, download=False, debian_dir=fake_debian)
    assert raw == root / "FashionMNIST" / "raw"
    monkeypatch.setattr("dpadapter.data.sources.DEBIAN_FASHION_MNIST", fake_debian)
    train, test = load_dataset("fashion-mnist", root)
    assert tuple(train.images.shape) == (30, 1, 28, 28) and len(test) == 12
    assert train.labels.tolist()[:11] == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0]


def test_missing_files_give_a_clear_error_naming_them(tmp_path):
    with pytest.raises(DatasetUnavailable) as exc:
        prepare_fashion_mnist(tmp_path / "data", download=False, debian_dir=tmp_path / "nowhere")
    msg = str(exc.value)
    assert "train-images-idx3-ubyte" in msg and "dataset-fashion-mnist" in msg


@pytest.mark.parametrize(
    "name,file",
    [("cifar10", "cifar-10-batches-py"), ("svhn", "train_32x32.mat"), ("stl10", "stl10_binary")],
)
def test_torchvision_sets_offline_name_their_files(tmp_path, name, file):
    with pytest.raises(DatasetUnavailable, match=file):
        load_dataset(name, tmp_path / "data", download=False)


def test_unknown_dataset(tmp_path):
    with pytest.raises(KeyError, match="unknown dataset"):
        load_dataset("imagenet-42", tmp_path)
