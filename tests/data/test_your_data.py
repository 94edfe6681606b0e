"""A researcher's own image folder (docs/your-data.md): every file decoded and checked at
validation, remembered in a manifest, fingerprinted by content; grey stays grey.

Folders are written here with PIL; the grey ones are scikit-learn's real handwritten digits."""

import copy
import shutil

import numpy as np
import pytest
import torch
from PIL import Image
from tiny_config import TINY_RAW

from dpadapter.data import DATASET_INFO, build_splits, load_dataset, manifest
from dpadapter.data import imagefolder as imf
from dpadapter.data.registry import data_fingerprint
from dpadapter.settings import ConfigError
from dpadapter.validation.compose import validate

NAME = "imagefolder:digits@8"


def _digits(base, per_class=6, classes=3, test=2, mode="L", test_dir="test"):
    """Real digits as 8x8 PNGs: `per_class` train and `test` test images of each class."""
    from sklearn.datasets import load_digits

    d = load_digits()
    for c in range(classes):
        imgs = d.images[d.target == c][: per_class + test]
        for i, img in enumerate(imgs):
            split = "train" if i < per_class else test_dir
            p = base / split / f"{c}" / f"{i}.png"
            p.parent.mkdir(parents=True, exist_ok=True)
            grey = Image.fromarray((img * 255 / 16).astype(np.uint8), "L")
            grey.convert(mode).save(p)
    return base


def _raw(root, **task):
    raw = copy.deepcopy(TINY_RAW)
    raw["data"]["root"] = str(root)
    raw["tasks"] = {"mine": {"dataset": NAME, "n_train": 10, "n_val": 2, "n_test": 4, **task}}
    raw["privacy"]["delta"] = 0.01
    raw["finetune"]["batch_size"] = 4
    return raw


@pytest.fixture
def root(tmp_path):
    _digits(tmp_path / "data" / "digits")
    return tmp_path / "data"


def _refused(root, *needles):
    with pytest.raises(ConfigError) as exc:
        validate(_raw(root), check_files=True)
    msg = str(exc.value)
    for n in needles:
        assert n in msg, msg
    assert msg.count("tasks.mine.dataset") == 1
    return msg


def test_a_clean_folder_validates_and_a_corrupt_image_is_refused_naming_it(root):
    validate(_raw(root), check_files=True)
    bad = root / "digits" / "train" / "1" / "3.png"
    bad.write_bytes(bad.read_bytes()[:40])  # truncated
    _refused(root, str(bad), "cannot be decoded", "replace or remove")
    bad.write_bytes(b"this is no png")
    _refused(root, str(bad), "cannot be decoded")


def test_a_non_image_file_in_a_class_folder_is_refused(root):
    stray = root / "digits" / "test" / "2" / "notes.txt"
    stray.write_text("not an image")
    _refused(root, str(stray), "not images", "move them out of the class folders")
    stray.unlink()
    (root / "digits" / "test" / "2" / ".DS_Store").write_text("hidden: skipped")
    validate(_raw(root), check_files=True)


def test_an_empty_class_folder_is_refused_in_any_split(root):
    (root / "digits" / "test" / "1").rename(root / "elsewhere")
    (root / "digits" / "test" / "1").mkdir()
    _refused(root, f"{root / 'digits' / 'test'}: class folders without images: 1")
    (root / "digits" / "test" / "1").rmdir()  # a class without test images needs no folder
    validate(_raw(root), check_files=True)


def test_the_same_image_in_two_splits_is_refused_naming_both(root):
    a = root / "digits" / "train" / "0" / "2.png"
    b = root / "digits" / "test" / "0" / "copy.png"
    shutil.copy(a, b)
    _refused(root, "in two splits", f"{a} = {b}", "remove one copy")


def test_val_alone_is_read_as_the_old_name_of_test(tmp_path, capsys):
    """(val/ beside test/ is the validation split: tests/data/test_validation_split.py)"""
    root = tmp_path / "data"
    _digits(root / "digits", test_dir="val")
    validate(_raw(root), check_files=True)
    assert DATASET_INFO[NAME].test_counts == (2, 2, 2)
    assert "val is read as the test split" in capsys.readouterr().err


def test_rechecking_an_unchanged_folder_decodes_nothing_and_an_edit_only_that_file(
    root, monkeypatch
):
    validate(_raw(root), check_files=True)
    first = data_fingerprint(NAME, root)
    decoded = []
    real = manifest._decode
    monkeypatch.setattr(manifest, "_decode", lambda p, st: decoded.append(p.name) or real(p, st))
    validate(_raw(root), check_files=True)
    assert decoded == [] and data_fingerprint(NAME, root) == first
    edited = root / "digits" / "train" / "2" / "4.png"
    Image.new("L", (8, 8), 7).save(edited)  # in place: same name
    validate(_raw(root), check_files=True)
    assert decoded == ["4.png"]
    edited_fp = data_fingerprint(NAME, root)
    assert edited_fp != first
    # a touch (mtime only) decodes the file again but the content, hence the fingerprint, stays
    edited.touch()
    validate(_raw(root), check_files=True)
    assert decoded == ["4.png", "4.png"] and data_fingerprint(NAME, root) == edited_fp
    # an image added or removed changes it too
    Image.new("L", (8, 8), 99).save(root / "digits" / "train" / "2" / "new.png")
    validate(_raw(root), check_files=True)
    added = data_fingerprint(NAME, root)
    (root / "digits" / "train" / "2" / "new.png").unlink()
    validate(_raw(root), check_files=True)
    assert len({first, edited_fp, added}) == 3 and data_fingerprint(NAME, root) == edited_fp


def test_the_fingerprint_is_of_content_not_of_where_the_folder_lies(root, tmp_path):
    validate(_raw(root), check_files=True)
    here = data_fingerprint(NAME, root)
    moved = tmp_path / "moved"
    shutil.copytree(root / "digits", moved / "digits")
    assert data_fingerprint(NAME, moved) == here
    # an absolute path names the folder wherever data.root is
    raw = _raw(tmp_path / "unrelated-root")
    raw["tasks"]["mine"]["dataset"] = f"imagefolder:{moved / 'digits'}@8"
    validate(raw, check_files=True)


def test_an_in_place_edit_rebuilds_the_tensor_cache(root):
    validate(_raw(root), check_files=True)
    train, _ = load_dataset(NAME, root)
    edited = root / "digits" / "train" / "0" / "0.png"
    Image.new("L", (8, 8), 255).save(edited)
    again, _ = load_dataset(NAME, root)
    assert torch.all(again.images[0] == 255) and not torch.equal(again.images, train.images)


def test_grey_stays_grey_on_the_default_grey_public_set(root, monkeypatch):
    """The default's public set is grey (Fashion-MNIST): a grey folder trains on its upstreams
    as it is, with public.channels untouched (no warm-up retrained)."""
    raw = _raw(root)
    raw["public"] = {"dataset": "fashion-mnist", "classes": [0, 1], "n_train": 20, "n_test": 4}
    raw["data"]["image_size"] = 8
    cfg = validate(raw, check_files=True)
    assert DATASET_INFO[NAME].channels == 1 and cfg.public.channels is None
    train, _ = load_dataset(NAME, root)
    assert tuple(train.images.shape[1:]) == (1, 8, 8)
    monkeypatch.chdir(root)
    plan, roles = build_splits(cfg)
    assert plan.in_chans == 1 and roles["mine"].train.tensors[0].shape[1] == 1


def test_a_colour_folder_with_a_grey_public_set_is_refused_naming_the_choice(tmp_path, monkeypatch):
    root = tmp_path / "data"
    _digits(root / "digits", mode="RGB")
    raw = _raw(root)
    raw["public"] = {"dataset": "synthetic", "classes": [0, 1], "n_train": 20, "n_test": 4}
    with pytest.raises(ConfigError) as exc:
        validate(raw, check_files=True)
    msg = str(exc.value)
    assert "3-channel images (colour)" in msg and "set tasks.mine.channels: 1" in msg, msg
    assert "public.channels: 3 (retrains the warm-up" in msg
    raw["tasks"]["mine"]["channels"] = 1
    raw["data"]["image_size"] = 8
    cfg = validate(raw, check_files=True)
    monkeypatch.chdir(root)
    plan, roles = build_splits(cfg)
    x = roles["mine"].train.tensors[0]
    assert plan.in_chans == 1 and x.shape[1] == 1


def test_a_grey_folder_with_a_colour_public_set_names_channels_3(root):
    raw = _raw(root)
    raw["public"] = {"dataset": "cifar10", "classes": [0, 1], "n_train": 20, "n_test": 4}
    with pytest.raises(ConfigError, match=r"set tasks\.mine\.channels: 3 \(its images replicated"):
        validate(raw)


def test_colour_to_grey_is_luminance():
    from dpadapter.data.tasks import _to_float

    rgb = torch.tensor([[[[255]], [[0]], [[0]]], [[[0]], [[255]], [[0]]]], dtype=torch.uint8)
    grey = _to_float(rgb, None, 1)
    assert grey.shape == (2, 1, 1, 1)
    assert torch.allclose(grey.flatten(), torch.tensor([0.299, 0.587]))


def test_mixed_grey_and_colour_is_colour(tmp_path):
    base = _digits(tmp_path / "d")
    Image.new("RGB", (8, 8), (1, 2, 3)).save(base / "train" / "0" / "rgb.png")
    assert imf.read_listing(base).channels == 3


def test_torchvision_files_are_fingerprinted_by_content(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    assert data_fingerprint("cifar10", tmp_path) is None  # not fetched yet
    folder.mkdir()
    for name in ("data_batch_1", "test_batch"):
        (folder / name).write_bytes(name.encode() * 10)
    first = data_fingerprint("cifar10", tmp_path)
    (folder / "test_batch").touch()
    assert data_fingerprint("cifar10", tmp_path) == first
    (folder / "test_batch").write_bytes(b"edited")
    assert data_fingerprint("cifar10", tmp_path) != first


def test_fashion_mnist_unpacked_or_packed_has_one_fingerprint(tmp_path, monkeypatch):
    """Before the first job unpacks the idx files, their packed copies are read: unpacking
    changes no trigger."""
    import gzip

    from dpadapter.data import sources

    packed = tmp_path / "debian"
    packed.mkdir()
    for i, f in enumerate(sources._FMNIST_FILES):
        with gzip.open(packed / f"{f}.gz", "wb") as out:
            out.write(bytes([i]) * 100)
    monkeypatch.setenv(sources.FMNIST_ENV, str(packed))
    root = tmp_path / "data"
    before = data_fingerprint("fashion-mnist", root)
    sources.prepare_fashion_mnist(root, download=False)
    assert (root / "FashionMNIST" / "raw" / sources._FMNIST_FILES[0]).is_file()
    assert data_fingerprint("fashion-mnist", root) == before is not None
