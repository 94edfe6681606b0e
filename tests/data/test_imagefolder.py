"""`imagefolder:<path>@<side>`: a local ImageFolder tree as a dataset, validated from its listing
before any job, resized once and cached; on a tiny folder of PNGs written here."""

import copy

import pytest
import torch
from tiny_config import TINY_RAW

from dpadapter.data import DATASET_INFO, DatasetUnavailable, build_splits, load_dataset
from dpadapter.data import imagefolder as imf
from dpadapter.data.registry import cache_path, missing_files
from dpadapter.settings import ConfigError
from dpadapter.validation.compose import validate

NAME = "imagefolder:pics/tiny@8"
# class -> (colour, train images, val images); folders listed out of order on purpose
CLASSES = {
    "zebra": ((200, 10, 30), 4, 2),
    "ant": ((0, 128, 255), 5, 2),
    "moth": ((77, 77, 77), 3, 0),
    "fly": ((5, 250, 5), 3, 1),
}


def _write_folder(root, test="test"):
    from PIL import Image

    base = root / "pics" / "tiny"
    for cls, (rgb, n_train, n_val) in CLASSES.items():
        for split, n in (("train", n_train), (test, n_val)):
            d = base / split / cls
            if n:  # a class without test images has no folder there
                d.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                # sizes differ (each is resized to 8x8), so no test image is a train image
                size = (16 + 4 * i + 2 * (split != "train"), 12 + 2 * i)
                if cls == "moth" and i == 0:
                    Image.new("L", size, rgb[0]).save(d / f"{i}.png")  # grey: becomes RGB
                else:
                    Image.new("RGB", size, rgb).save(d / f"{i}.png")
    return base


@pytest.fixture
def root(tmp_path):
    r = tmp_path / "data"
    _write_folder(r)
    return r


def _raw(root):
    raw = copy.deepcopy(TINY_RAW)
    raw["data"]["root"] = str(root)
    raw["public"] = {"dataset": NAME, "classes": [0, 3], "n_train": 6, "n_test": 2}
    t = {"dataset": NAME, "classes": [1, 2], "n_train": 3, "n_val": 1, "n_test": 1}
    raw["tasks"] = {"t": t}
    raw["privacy"]["delta"] = 0.01
    raw["finetune"]["batch_size"] = 2
    return raw


def test_counts_come_from_the_listing_at_validation(root):
    cfg = validate(_raw(root), check_files=True)
    info = DATASET_INFO[NAME]
    # sorted class folders: ant 0, fly 1, moth 2, zebra 3
    assert info.train_counts == (5, 3, 3, 4) and info.test_counts == (2, 1, 0, 2)
    assert cfg.public.dataset == NAME
    raw = _raw(root)
    raw["tasks"]["t"]["n_train"] = 6  # fly + moth have 6 train images: 6 + 1 > 6
    with pytest.raises(ConfigError, match=r"tasks\.t\.n_train.*which has 6"):
        validate(raw)
    raw = _raw(root)
    raw["public"]["classes"] = [0, 4]
    with pytest.raises(ConfigError, match=r"public\.classes: \[4\] out of range"):
        validate(raw)


def test_missing_folder_and_bad_names_fail_validation_naming_the_key(tmp_path, root):
    raw = _raw(root)
    raw["data"]["root"] = str(tmp_path / "elsewhere")
    validate(raw)  # data not there (yet) is the workflow's file check, as for any dataset
    with pytest.raises(ConfigError) as exc:
        validate(raw, check_files=True)
    msg = str(exc.value)
    assert "public.dataset: image folder" in msg and str(tmp_path / "elsewhere/pics/tiny") in msg
    assert msg.count("image folder") == 1  # reported once
    assert "unknown dataset" not in msg
    assert NAME not in DATASET_INFO  # a failed reading leaves no stale entry
    raw = _raw(root)
    raw["public"]["dataset"] = "imagefolder:pics/tiny"
    with pytest.raises(ConfigError, match=r"public\.dataset: .*imagefolder:<folder"):
        validate(raw)
    import shutil

    shutil.rmtree(root / "pics" / "tiny" / "train")
    with pytest.raises(ConfigError, match=r"public\.dataset: (.|\n)*tiny/train is not a folder"):
        validate(_raw(root), check_files=True)
    assert "tiny/train is not a folder" in missing_files(NAME, root, False)


def test_images_are_resized_once_and_read_from_the_cache_after(root, monkeypatch):
    assert missing_files(NAME, root, False) is None
    train, test = load_dataset(NAME, root)
    assert tuple(train.images.shape) == (15, 3, 8, 8) and tuple(test.images.shape) == (5, 3, 8, 8)
    assert train.labels.tolist() == [0] * 5 + [1] * 3 + [2] * 3 + [3] * 4
    assert test.labels.tolist() == [0, 0, 1, 3, 3]
    colours = {0: (0, 128, 255), 1: (5, 250, 5), 2: (77, 77, 77), 3: (200, 10, 30)}
    for x, y in zip(train.images, train.labels, strict=True):
        want = torch.tensor(colours[int(y)], dtype=torch.uint8).view(3, 1, 1).expand(3, 8, 8)
        assert torch.equal(x, want)
    cache = cache_path(NAME, root)
    assert cache.parent == root / ".cache" and cache.is_file()

    def no_decoding(*a, **k):
        raise AssertionError("decoded an image although the cache exists")

    monkeypatch.setattr(imf, "_read_image", no_decoding)
    again, again_test = load_dataset(NAME, root)
    assert torch.equal(again.images, train.images) and torch.equal(again.labels, train.labels)
    assert torch.equal(again_test.images, test.images)


def test_build_splits_carves_roles_from_the_folder(root, monkeypatch):
    monkeypatch.chdir(root.parent)
    cfg = validate(_raw(root))
    plan, roles = build_splits(cfg)
    assert plan.in_chans == 3 and plan.image_size == 8
    assert len(roles["public"].train) == 6 and roles["public"].num_classes == 2
    t = roles["t"]
    assert (len(t.train), len(t.val), len(t.test), t.num_classes) == (3, 1, 1, 2)


def test_unreadable_layouts_are_refused(tmp_path):
    base = tmp_path / "f"
    (base / "train" / "a").mkdir(parents=True)
    (base / "test").mkdir(parents=True)
    with pytest.raises(DatasetUnavailable, match="test has no class folders"):
        imf.read_listing(base)
    (base / "test" / "a").mkdir()
    with pytest.raises(DatasetUnavailable, match="without images"):
        imf.read_listing(base)
    _png(base / "train" / "a" / "x.png", 1)
    _png(base / "test" / "a" / "x.png", 2)
    _png(base / "test" / "b" / "y.png", 3)
    with pytest.raises(DatasetUnavailable, match="not in train"):
        imf.read_listing(base)
    assert imf.parse_spec("a/b@32") == ("a/b", 32)
    for bad in ("a", "a@", "@32", "a@x", "a@0"):
        with pytest.raises(ValueError):
            imf.parse_spec(bad)


def test_each_image_is_decoded_once_for_validation_and_never_again_to_load(root, monkeypatch):
    """Validation decodes every image once (the manifest, dpadapter.data.manifest); the checks
    of loading (and of a new validation) only stat them; the loader decodes them to tensors
    once, and later loads read the tensor cache."""
    from dpadapter.data import manifest
    from dpadapter.data.registry import load_dataset

    calls = []
    real = manifest._decode
    monkeypatch.setattr(manifest, "_decode", lambda p, st: calls.append(p) or real(p, st))
    cfg = validate(_raw(root), check_files=True)
    assert len(calls) == 20
    load_dataset(NAME, cfg.data.root)
    validate(_raw(root))
    assert len(calls) == 20


def test_without_a_test_folder_the_test_sets_come_from_train(tmp_path, monkeypatch):
    """No test/ folder (the test sets are carved from train/ with `test_split: train`): it
    validates, loads, is cached and read back; a role that wants test images from the missing
    split is refused at validation, naming its key."""
    root = tmp_path / "data"
    for cls in ("a", "b"):
        _write_class(root / "pics" / "tiny", cls, seed=ord(cls))
    raw = _raw(root)
    raw["public"] = {"dataset": NAME, "n_train": 2, "n_test": 2, "test_split": "train"}
    t = {"dataset": NAME, "n_train": 2, "n_val": 1, "n_test": 1, "test_split": "train"}
    raw["tasks"] = {"t": t}
    cfg = validate(raw, check_files=True)
    train, test = load_dataset(NAME, root)
    assert tuple(train.images.shape) == (10, 3, 8, 8) and tuple(test.images.shape) == (0, 3, 8, 8)
    monkeypatch.setattr(imf, "_read_image", lambda *a: pytest.fail("decoded despite the cache"))
    again, again_test = load_dataset(NAME, root)
    assert torch.equal(again.images, train.images) and again_test.labels.numel() == 0
    monkeypatch.chdir(tmp_path)
    _, roles = build_splits(cfg)
    assert len(roles["t"].test) == 1 and len(roles["public"].test) == 2
    raw["tasks"]["t"].pop("test_split")
    with pytest.raises(ConfigError, match=r"tasks\.t\.n_test"):
        validate(raw)


def _png(path, seed, mode="RGB", size=(8, 8)):
    """An image of its own content (random pixels from `seed`)."""
    import numpy as np
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    shape = (size[1], size[0]) + ((3,) if mode == "RGB" else ())
    pixels = np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)
    Image.fromarray(pixels, mode).save(path)


def _write_class(base, cls, n_train=5, seed=0, mode="RGB"):
    for i in range(n_train):
        _png(base / "train" / cls / f"{i}.png", seed * 1000 + i, mode)
