"""scikit-learn's digits as a private task: counts known before loading, a fixed disjoint split,
resized to the public side and normalised by the public set's numbers (data.sklearn_digits)."""

import pytest
import torch

from dpadapter.data import DATASET_INFO, build_splits, load_dataset, missing_files
from dpadapter.data import sklearn_digits as digits
from dpadapter.settings import from_dict


@pytest.fixture
def digits_raw(tiny_raw, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tiny_raw["tasks"]["digits"] = {
        "dataset": digits.NAME,
        "classes": list(range(10)),
        "n_train": 1000,
        "n_val": 200,
        "n_test": 596,
    }
    return tiny_raw


def test_registered_counts_are_the_loaders(tmp_path):
    train, test = load_dataset(digits.NAME, tmp_path)
    info = DATASET_INFO[digits.NAME]
    assert torch.bincount(train.labels, minlength=10).tolist() == list(info.train_counts)
    assert torch.bincount(test.labels, minlength=10).tolist() == list(info.test_counts)
    assert len(train) + len(test) == 1797
    assert tuple(train.images.shape[1:]) == (1, 8, 8) and train.images.dtype == torch.uint8
    assert int(train.images.max()) == 255 and int(train.images.min()) == 0


def test_split_is_fixed_and_disjoint(tmp_path):
    from sklearn.datasets import load_digits

    d = load_digits()
    labels = torch.as_tensor(d.target)
    mask = digits.is_test(labels)
    train, test = load_dataset(digits.NAME, tmp_path / "a")
    # the same images, in file order, on each side: every image once, on one side only
    flat = torch.as_tensor(d.images).mul(255 / 16).round().to(torch.uint8).flatten(1)
    assert torch.equal(test.images.flatten(1), flat[mask])
    assert torch.equal(train.images.flatten(1), flat[~mask])
    assert torch.equal(load_dataset(digits.NAME, tmp_path / "b")[1].labels, labels[mask])


def test_a_private_task_resized_and_normalised_by_the_public_set(digits_raw):
    cfg = from_dict(digits_raw)
    plan, roles = build_splits(cfg, ["digits"])
    task = roles["digits"]
    a = plan.allocations["digits"]
    assert (len(task.train), len(task.val), len(task.test)) == (1000, 200, 596)
    assert task.num_classes == 10
    assert set(a.train.tolist()).isdisjoint(a.val.tolist())
    side = plan.image_size  # the public set's (synthetic: 16)
    x = task.test.tensors[0]
    assert tuple(x.shape[1:]) == (1, side, side)
    # undoing the public set's normalisation gives the resized digits back, pixel for pixel
    _, test_pool = load_dataset(digits.NAME, cfg.data.root)
    raw = test_pool.images[a.test].float() / 255
    resized = torch.nn.functional.interpolate(raw, size=(side, side), mode="bilinear")
    assert torch.allclose(x * plan.std.view(1, -1, 1, 1) + plan.mean.view(1, -1, 1, 1), resized,
                          atol=1e-5)  # fmt: skip
    # the public statistics are the public set's alone: adding the task does not move them
    del digits_raw["tasks"]["digits"]
    alone, _ = build_splits(from_dict(digits_raw), ["public"])
    assert torch.equal(alone.mean, plan.mean) and torch.equal(alone.std, plan.std)


def test_asking_for_more_than_the_split_holds_fails_at_validation(digits_raw):
    from dpadapter.settings import ConfigError
    from dpadapter.validation.compose import validate

    validate(digits_raw)  # all 596 test images: fine
    digits_raw["tasks"]["digits"]["n_test"] = 597
    with pytest.raises(ConfigError, match="tasks.digits"):
        validate(digits_raw)


def test_missing_scikit_learn_is_named(tmp_path, monkeypatch):
    monkeypatch.setattr(digits, "_data_file", lambda: None)
    msg = missing_files(digits.NAME, tmp_path, False)
    assert msg is not None and "scikit-learn" in msg
