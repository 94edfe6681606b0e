"""An image folder's own validation split (docs/your-data.md): `val/` (or `validation/`)
beside `test/` is the tasks' validation set, used whole, never carved from train nor mixed into
training or test; checked like the other splits; `val/` alone stays the test split's old name.

Train and test images are scikit-learn's real digits; the validation images are flat squares
(a value no digit has), so where each one went can be read off the tensors."""

import copy
import shutil

import numpy as np
import pytest
import torch
from PIL import Image
from tiny_config import TINY_RAW

from dpadapter.data import DATASET_INFO, build_splits, load_dataset
from dpadapter.data import imagefolder as imf
from dpadapter.data.registry import data_fingerprint
from dpadapter.data.sizes import task_sizes
from dpadapter.settings import ConfigError
from dpadapter.validation.compose import validate

NAME = "imagefolder:digits@8"
CLASSES, PER_CLASS, TEST, VAL = 4, 6, 2, 2


def _val_value(c, i):
    return 250 - 10 * (VAL * c + i)  # 250, 240, ...: one flat value per validation image


def _folder(base, val_dir="val", test_dir="test"):
    from sklearn.datasets import load_digits

    d = load_digits()
    for c in range(CLASSES):
        for i, img in enumerate(d.images[d.target == c][: PER_CLASS + TEST]):
            p = base / ("train" if i < PER_CLASS else test_dir) / f"{c}" / f"{i}.png"
            p.parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray((img * 255 / 16).astype(np.uint8), "L").save(p)
        if val_dir:
            (base / val_dir / f"{c}").mkdir(parents=True, exist_ok=True)
            for i in range(VAL):
                Image.new("L", (8, 8), _val_value(c, i)).save(base / val_dir / f"{c}" / f"v{i}.png")
    return base


@pytest.fixture
def root(tmp_path):
    _folder(tmp_path / "data" / "digits")
    return tmp_path / "data"


def _raw(root, **task):
    raw = copy.deepcopy(TINY_RAW)
    raw["data"]["root"] = str(root)
    raw["data"]["image_size"] = 8
    raw["tasks"] = {"mine": {"dataset": NAME, "n_train": 12, "n_test": 4, **task}}
    raw["privacy"]["delta"] = 0.01
    raw["finetune"]["batch_size"] = 4
    return raw


def _refused(raw, *needles):
    with pytest.raises(ConfigError) as exc:
        validate(raw, check_files=True)
    msg = str(exc.value)
    for n in needles:
        assert n in msg, msg
    return msg


def _pixels(plan, x):
    """The uint8 values behind normalised grey images."""
    raw = x * plan.std.view(1, -1, 1, 1) + plan.mean.view(1, -1, 1, 1)
    return (raw * 255).round().to(torch.int64)


@pytest.mark.parametrize("val_dir", ["val", "validation"])
def test_the_validation_folder_is_the_validation_set_and_nothing_else(
    tmp_path, monkeypatch, val_dir
):
    root = tmp_path / "data"
    _folder(root / "digits", val_dir=val_dir)
    cfg = validate(_raw(root), check_files=True)
    info = DATASET_INFO[NAME]
    assert info.val_counts == (VAL,) * CLASSES and info.test_counts == (TEST,) * CLASSES
    assert info.train_counts == (PER_CLASS,) * CLASSES
    monkeypatch.chdir(root)
    plan, roles = build_splits(cfg)
    d = roles["mine"]
    assert d.allocation.val_split == "val"
    assert (len(d.train), len(d.val), len(d.test)) == (12, VAL * CLASSES, 4)
    flat = {_val_value(c, i): c for c in range(CLASSES) for i in range(VAL)}
    x_val, y_val = d.val.tensors
    px = _pixels(plan, x_val)
    # every validation example is one of the flat squares, each once, with its class's label
    assert all(bool((p == p.flatten()[0]).all()) for p in px)
    got = sorted((int(p.flatten()[0]), int(y)) for p, y in zip(px, y_val, strict=True))
    assert got == sorted(flat.items())
    # and no training or test example is
    for split in (d.train, d.test):
        p = _pixels(plan, split.tensors[0]).flatten(1)
        flat_rows = (p == p[:, :1]).all(dim=1) & torch.isin(p[:, 0], torch.tensor(list(flat)))
        assert not flat_rows.any()


def test_n_val_is_absent_or_the_folders_size_anything_else_is_refused_naming_it(root):
    validate(_raw(root), check_files=True)
    validate(_raw(root, n_val=VAL * CLASSES), check_files=True)
    validate(_raw(root, classes=[0, 2], n_train=8, n_val=2 * VAL), check_files=True)
    msg = _refused(_raw(root, n_val=2), "tasks.mine.n_val: 2", "validation split of its own")
    assert f"set it to {VAL * CLASSES}" in msg and "move val/'s images into train/" in msg
    _refused(_raw(root, classes=[0, 2], n_train=8, n_val=VAL * CLASSES), "tasks.mine.n_val")


def test_the_validation_split_takes_nothing_from_train(root, monkeypatch):
    # all of train/ for training: with n_val carved from train this would ask for too many
    cfg = validate(_raw(root, n_train=PER_CLASS * CLASSES, n_val=VAL * CLASSES), check_files=True)
    assert task_sizes(cfg) == {"mine": PER_CLASS * CLASSES}
    cfg = validate(_raw(root, n_train=None), check_files=True)
    assert task_sizes(cfg) == {"mine": PER_CLASS * CLASSES}
    monkeypatch.chdir(root)
    _, roles = build_splits(cfg)
    assert len(roles["mine"].train) == PER_CLASS * CLASSES
    _refused(_raw(root, n_train=PER_CLASS * CLASSES + 1), "tasks.mine.n_train", "(n_train)")


def test_two_tasks_share_the_validation_split_only_by_disjoint_classes(root):
    raw = _raw(root, classes=[0, 1], n_train=4, n_test=2)
    raw["tasks"]["other"] = {"dataset": NAME, "classes": [2, 3], "n_train": 4, "n_test": 2}
    validate(raw, check_files=True)
    raw["tasks"]["other"]["classes"] = [1, 3]
    _refused(raw, "tasks.other.n_val", "val examples (n_val)")


def test_the_validation_split_is_checked_like_the_others(root):
    val = root / "digits" / "val"
    # the same image in validation and test, or in validation and train
    shutil.copy(root / "digits" / "test" / "1" / "6.png", val / "1" / "leak.png")
    _refused(_raw(root), "in two splits", f"{val / '1' / 'leak.png'}", "remove one copy")
    (val / "1" / "leak.png").unlink()
    shutil.copy(root / "digits" / "train" / "2" / "0.png", val / "2" / "leak.png")
    _refused(_raw(root), f"{root / 'digits' / 'train' / '2' / '0.png'} = {val / '2' / 'leak.png'}")
    (val / "2" / "leak.png").unlink()
    # a corrupt image, a non-image file, an empty class folder, a class train/ lacks
    (val / "0" / "v0.png").write_bytes(b"no png")
    _refused(_raw(root), str(val / "0" / "v0.png"), "cannot be decoded")
    Image.new("L", (8, 8), 3).save(val / "0" / "v0.png")
    (val / "0" / "notes.txt").write_text("x")
    _refused(_raw(root), str(val / "0" / "notes.txt"), "not images")
    (val / "0" / "notes.txt").unlink()
    (val / "9").mkdir()
    _refused(_raw(root), f"{val}: class folders without images: 9")
    Image.new("L", (8, 8), 1).save(val / "9" / "a.png")
    _refused(_raw(root), f"{val}: class folders not in train/: 9")
    shutil.rmtree(val / "9")
    validate(_raw(root), check_files=True)
    # both names at once: which one is meant is not guessed
    shutil.copytree(val, root / "digits" / "validation")
    _refused(_raw(root), "both val/ and validation/")


def test_the_fingerprint_and_the_tensor_cache_cover_the_validation_split(root, monkeypatch):
    validate(_raw(root), check_files=True)
    first = data_fingerprint(NAME, root)
    train, test, val = load_dataset(NAME, root)
    assert (len(train), len(test), len(val)) == (
        PER_CLASS * CLASSES,
        TEST * CLASSES,
        VAL * CLASSES,
    )
    assert val.labels.tolist() == [c for c in range(CLASSES) for _ in range(VAL)]
    Image.new("L", (8, 8), 7).save(root / "digits" / "val" / "1" / "v0.png")  # in place
    validate(_raw(root), check_files=True)
    assert data_fingerprint(NAME, root) != first
    edited = load_dataset(NAME, root)[2]
    assert int(edited.images[2].max()) == 7 and torch.equal(edited.images[:2], val.images[:2])

    def no_decoding(*a, **k):
        raise AssertionError("decoded an image although the cache is sound")

    monkeypatch.setattr(imf, "_read_image", no_decoding)
    assert torch.equal(load_dataset(NAME, root)[2].images, edited.images)  # from the cache


def test_val_alone_keeps_its_old_meaning_and_n_val_is_carved_from_train(tmp_path, capsys):
    root = tmp_path / "data"
    _folder(root / "digits", val_dir=None, test_dir="val")
    cfg = validate(_raw(root, n_val=3), check_files=True)
    info = DATASET_INFO[NAME]
    assert info.val_counts is None and info.test_counts == (TEST,) * CLASSES
    assert "val is read as the test split" in capsys.readouterr().err
    assert len(load_dataset(NAME, root)) == 2
    assert task_sizes(cfg) == {"mine": 12}
    # beside that old-named test split, validation/ is the validation split
    _folder(root / "digits", val_dir="validation", test_dir="val")
    validate(_raw(root), check_files=True)
    assert DATASET_INFO[NAME].val_counts == (VAL,) * CLASSES
    assert DATASET_INFO[NAME].test_counts == (TEST,) * CLASSES
