"""The dataset tensor cache: the same tensors as a decode, rebuilt whenever it cannot be trusted
(sources changed, an old format, truncated or corrupted), written atomically by jobs that start
together, and read without importing torchvision."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import struct
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from dpadapter.data import load_dataset, tensor_cache
from dpadapter.data import sources as src
from dpadapter.data.registry import DATASETS, cache_path
from dpadapter.data.sources import DEBIAN_FASHION_MNIST

SRC = str(Path(__file__).resolve().parents[2] / "src")


def _idx(path: Path, arr: torch.Tensor, magic: int) -> None:
    head = struct.pack(">I", magic) + b"".join(struct.pack(">I", d) for d in arr.shape)
    path.write_bytes(head + arr.numpy().tobytes())


def _fake_fmnist(root: Path, n_train: int = 20, n_test: int = 10, seed: int = 0) -> None:
    """A tiny Fashion-MNIST in torchvision's raw layout (torchvision checks no hash of it)."""
    raw = root / "FashionMNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        x = torch.randint(0, 256, (n, 28, 28), generator=g, dtype=torch.uint8)
        y = torch.randint(0, 10, (n,), generator=g, dtype=torch.uint8)
        _idx(raw / f"{prefix}-images-idx3-ubyte", x, 0x803)
        _idx(raw / f"{prefix}-labels-idx1-ubyte", y, 0x801)


def _decoded(root: Path):
    """What the loader decodes, bypassing the cache (and the counting)."""
    return src.fashion_mnist(root, False)


def _same(a, b) -> bool:
    return all(
        torch.equal(x.images, y.images)
        and torch.equal(x.labels, y.labels)
        and x.images.dtype == y.images.dtype
        and x.labels.dtype == y.labels.dtype
        for x, y in zip(a, b, strict=True)
    )


@pytest.fixture
def counted(monkeypatch):
    """How often the Fashion-MNIST loader decodes its files."""
    calls = []
    real = DATASETS["fashion-mnist"]

    def loader(root, download):
        calls.append(root)
        return real(root, download)

    monkeypatch.setitem(DATASETS, "fashion-mnist", loader)
    return calls


def test_second_load_reads_the_cache_and_equals_the_decode(tmp_path, counted):
    _fake_fmnist(tmp_path)
    first = load_dataset("fashion-mnist", tmp_path)
    assert len(counted) == 1 and cache_path("fashion-mnist", tmp_path).is_file()
    second = load_dataset("fashion-mnist", tmp_path)
    assert len(counted) == 1  # no second decode
    assert _same(first, second) and _same(second, _decoded(tmp_path))
    assert tuple(second[0].images.shape) == (20, 1, 28, 28) and len(second[1]) == 10
    assert [p.name for p in (tmp_path / ".cache").iterdir()] == ["fashion-mnist.pt"]


@pytest.mark.skipif(
    not (DEBIAN_FASHION_MNIST / "train-images-idx3-ubyte.gz").is_file(),
    reason="Debian's dataset-fashion-mnist is not installed",
)
def test_real_fashion_mnist_cache_is_bit_identical_to_torchvision(tmp_path, counted):
    from dpadapter.compat.torchvision_ops import import_torchvision

    load_dataset("fashion-mnist", tmp_path)  # unpacks Debian's files and writes the cache
    train, test = load_dataset("fashion-mnist", tmp_path)
    assert len(counted) == 1
    tv = import_torchvision()
    for split, train_flag in ((train, True), (test, False)):
        ds = tv.datasets.FashionMNIST(str(tmp_path), train=train_flag)
        assert torch.equal(split.images, ds.data.unsqueeze(1))
        assert split.labels.dtype == torch.long and torch.equal(split.labels, ds.targets)
    with gzip.open(DEBIAN_FASHION_MNIST / "t10k-labels-idx1-ubyte.gz") as f:
        assert test.labels.tolist() == list(f.read()[8:])
    assert len(train) == 60000 and len(test) == 10000


def test_a_changed_source_file_rebuilds_the_cache(tmp_path, counted):
    _fake_fmnist(tmp_path, seed=0)
    old = load_dataset("fashion-mnist", tmp_path)
    _fake_fmnist(tmp_path, seed=1)  # same sizes, new pixels and labels, new mtimes
    raw = tmp_path / "FashionMNIST" / "raw" / "train-images-idx3-ubyte"
    os.utime(raw, ns=(raw.stat().st_atime_ns, raw.stat().st_mtime_ns + 10**9))
    new = load_dataset("fashion-mnist", tmp_path)
    assert len(counted) == 2
    assert _same(new, _decoded(tmp_path)) and not torch.equal(new[0].images, old[0].images)
    _fake_fmnist(tmp_path, n_train=21)  # a bigger source
    assert len(load_dataset("fashion-mnist", tmp_path)[0]) == 21 and len(counted) == 3


def _flip_a_pixel_byte(path: Path, needle: bytes) -> None:
    data = bytearray(path.read_bytes())
    i = data.find(needle)
    assert i > 0
    data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_corrupted_cache_is_never_used(tmp_path, counted, caplog):
    _fake_fmnist(tmp_path)
    truth = load_dataset("fashion-mnist", tmp_path)
    cache = cache_path("fashion-mnist", tmp_path)
    # one flipped bit inside the stored training images: torch.load reads it without complaint
    _flip_a_pixel_byte(cache, truth[0].images[3].numpy().tobytes()[:64])
    assert not torch.equal(torch.load(cache, weights_only=True)["train"][0], truth[0].images)
    again = load_dataset("fashion-mnist", tmp_path)
    assert len(counted) == 2 and _same(again, truth)
    assert "fail their checksum" in caplog.text
    # the rebuilt cache is sound again: read without decoding
    assert _same(load_dataset("fashion-mnist", tmp_path), truth) and len(counted) == 2


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty", "old-format", "other-key"])
def test_an_unreadable_or_foreign_cache_is_rebuilt(tmp_path, counted, damage):
    _fake_fmnist(tmp_path)
    truth = load_dataset("fashion-mnist", tmp_path)
    cache = cache_path("fashion-mnist", tmp_path)
    data = cache.read_bytes()
    if damage == "truncated":
        cache.write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        cache.write_bytes(b"not a torch file" * 100)
    elif damage == "empty":
        cache.write_bytes(b"")
    elif damage == "old-format":  # what earlier versions wrote: no format, no key, no checksum
        old = {"train": (truth[0].images[:5], truth[0].labels[:5])}
        torch.save({**old, "test": (truth[1].images, truth[1].labels)}, cache)
    else:  # a sound cache of other sources (another root's files copied over)
        d = torch.load(cache, weights_only=True)
        d["source"] = json.dumps([["elsewhere", 1, 2]])
        torch.save(d, cache)
    assert _same(load_dataset("fashion-mnist", tmp_path), truth) and len(counted) == 2


def test_a_failed_write_leaves_no_file_behind(tmp_path, monkeypatch):
    _fake_fmnist(tmp_path)

    def dies(obj, f, *a, **k):
        Path(f).write_bytes(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(tensor_cache.torch, "save", dies)
    with pytest.raises(OSError, match="disk full"):
        load_dataset("fashion-mnist", tmp_path)
    assert list((tmp_path / ".cache").iterdir()) == []


_WORKER = """
import hashlib, sys
from dpadapter.data import load_dataset
tr, te = load_dataset("fashion-mnist", sys.argv[1])
h = hashlib.sha256()
for t in (tr.images, tr.labels, te.images, te.labels):
    h.update(t.numpy().tobytes())
print(h.hexdigest(), "torchvision" in sys.modules)
"""


def _digest(splits) -> str:
    h = hashlib.sha256()
    for s in splits:
        h.update(s.images.numpy().tobytes())
        h.update(s.labels.numpy().tobytes())
    return h.hexdigest()


def test_jobs_starting_together_share_one_sound_cache(tmp_path, monkeypatch):
    """Four loads that all miss the cache decode and write at once (a barrier holds each decode
    until all have started): every one gets the true tensors, one sound file is left."""
    _fake_fmnist(tmp_path, n_train=600, n_test=200)
    truth = _digest(_decoded(tmp_path))
    n = 4
    barrier = threading.Barrier(n, timeout=60)

    def loader(root, download):
        barrier.wait()
        return src.fashion_mnist(root, download)

    monkeypatch.setitem(DATASETS, "fashion-mnist", loader)
    with ThreadPoolExecutor(n) as pool:
        got = list(pool.map(lambda _: _digest(load_dataset("fashion-mnist", tmp_path)), range(n)))
    assert got == [truth] * n
    assert [p.name for p in (tmp_path / ".cache").iterdir()] == ["fashion-mnist.pt"]
    monkeypatch.setitem(DATASETS, "fashion-mnist", None)  # a decode now would fail
    assert _digest(load_dataset("fashion-mnist", tmp_path)) == truth


@pytest.mark.process
def test_a_later_job_reads_the_cache_without_torchvision(tmp_path):
    _fake_fmnist(tmp_path)
    truth = _digest(load_dataset("fashion-mnist", tmp_path))
    env = {**os.environ, "PYTHONPATH": SRC}
    out = subprocess.run(
        [sys.executable, "-c", _WORKER, str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    assert out.stdout.split() == [truth, "False"], out.stderr


def test_synthetic_is_made_by_code_and_never_cached(tmp_path):
    a = load_dataset("synthetic", tmp_path)
    assert _same(a, DATASETS["synthetic"](tmp_path, False))
    assert not (tmp_path / ".cache").exists()


def test_torchvision_folders_key_the_cache_by_every_file_in_them(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    for name in ("data_batch_1", "test_batch"):
        (folder / name).write_bytes(b"x")
    sources = src._torchvision_sources(["cifar-10-batches-py/"])(tmp_path)
    assert [p.name for p in sources] == ["data_batch_1", "test_batch"]
    key = tensor_cache.signature(tmp_path, sources)
    (folder / "test_batch").write_bytes(b"xy")
    assert tensor_cache.signature(tmp_path, sources) != key
