"""Public set and tasks are disjoint, test examples never leave the test pool, stats are public."""

import pytest
import torch

from dpadapter.data import build_splits
from dpadapter.data.tasks import SplitError
from dpadapter.settings import from_dict


def _pairs(allocs):
    for which in ("train", "val", "test"):
        for a in allocs.values():
            yield which, a


def test_roles_are_disjoint_within_each_source_pool(tiny_cfg):
    plan, roles = build_splits(tiny_cfg)
    allocs = plan.allocations
    train_side = [torch.cat([a.train, a.val]) for a in allocs.values()]
    test_side = [a.test for a in allocs.values()]
    for side in (train_side, test_side):
        allidx = torch.cat(side)
        assert allidx.numel() == allidx.unique().numel(), "an example belongs to two roles"
    for a in allocs.values():
        assert set(a.train.tolist()).isdisjoint(a.val.tolist())


def test_test_split_comes_only_from_the_source_test_pool(tiny_cfg):
    from dpadapter.data import load_dataset

    plan, roles = build_splits(tiny_cfg, ["syn-same"])
    a = plan.allocations["syn-same"]
    _, test_pool = load_dataset("synthetic", tiny_cfg.data.root)
    x_test = roles["syn-same"].test.tensors[0]
    raw = test_pool.images[a.test].float() / 255
    expect = (raw - plan.mean.view(1, -1, 1, 1)) / plan.std.view(1, -1, 1, 1)
    assert torch.allclose(x_test, expect)
    # and the training tensors share no image with the test tensors
    x_train = roles["syn-same"].train.tensors[0].flatten(1)
    d = torch.cdist(x_train, x_test.flatten(1))
    assert d.min() > 0


def test_sizes_classes_and_relabelling(tiny_cfg):
    _, roles = build_splits(tiny_cfg)
    shift = roles["syn-shift"]
    assert (len(shift.train), len(shift.val), len(shift.test)) == (400, 100, 300)
    assert sorted(shift.train.tensors[1].unique().tolist()) == [0, 1, 2, 3, 4]
    assert shift.num_classes == 5


def test_normalisation_uses_public_training_images_only(tiny_raw, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    a, _ = build_splits(from_dict(tiny_raw), ["public"])
    tiny_raw["tasks"]["syn-shift"]["n_train"] = 200  # a private change must not move the stats
    b, _ = build_splits(from_dict(tiny_raw), ["public"])
    assert torch.equal(a.mean, b.mean) and torch.equal(a.std, b.std)
    assert torch.equal(a.allocations["public"].train, b.allocations["public"].train)


def test_splits_are_deterministic_and_seeded(tiny_raw, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    a, _ = build_splits(from_dict(tiny_raw), [])
    b, _ = build_splits(from_dict(tiny_raw), [])
    tiny_raw["data"]["split_seed"] = 1
    c, _ = build_splits(from_dict(tiny_raw), [])
    assert torch.equal(a.allocations["syn-same"].train, b.allocations["syn-same"].train)
    assert not torch.equal(a.allocations["syn-same"].train, c.allocations["syn-same"].train)


def test_over_asking_is_a_clear_error(tiny_raw, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tiny_raw["tasks"]["syn-same"]["n_train"] = 10_000
    with pytest.raises(SplitError, match="syn-same"):
        build_splits(from_dict(tiny_raw), [])


def test_test_examples_carved_from_the_training_split(tiny_raw, tmp_path, monkeypatch):
    """DP-SAT's "0.8:0.2 split of the training data" (test_split: train): the test examples
    come from the source's training pool, after the role's train+val, disjoint from them and
    from every other role; a public set may draw from the source's test split instead."""
    monkeypatch.chdir(tmp_path)
    tiny_raw["public"].update(
        {"train_split": "test", "test_split": "test", "n_train": 300, "n_test": 100}
    )
    tiny_raw["tasks"]["syn-same"]["test_split"] = "train"
    plan, roles = build_splits(from_dict(tiny_raw))
    a, pub = plan.allocations["syn-same"], plan.allocations["public"]
    assert (a.train_split, a.test_split) == ("train", "train")
    assert (pub.train_split, pub.test_split) == ("test", "test")
    train_side = [a.train, a.val, a.test, plan.allocations["syn-shift"].train]
    train_side.append(plan.allocations["syn-shift"].val)
    allidx = torch.cat(train_side)
    assert allidx.numel() == allidx.unique().numel(), "an example of the train pool is reused"
    test_side = torch.cat([pub.train, pub.test, plan.allocations["syn-shift"].test])
    assert test_side.numel() == test_side.unique().numel()
    assert len(roles["syn-same"].test) == tiny_raw["tasks"]["syn-same"]["n_test"]
    from dpadapter.data import load_dataset

    train_pool, _ = load_dataset("synthetic", "data")
    assert torch.equal(roles["syn-same"].test.tensors[1], train_pool.labels[a.test])


def test_grey_roles_replicated_to_rgb_and_mismatches_refused_before_any_job(
    tiny_raw, tmp_path, monkeypatch
):
    """Pretrain-DPFL feeds Fashion-MNIST to an RGB backbone as 3x32x32: `channels: 3` repeats
    the grey value in each channel (then normalises per channel with public statistics); a
    role whose channels differ from the public set's is refused at validation, naming the key."""
    from dpadapter.settings import ConfigError
    from dpadapter.validation.compose import validate

    monkeypatch.chdir(tmp_path)
    _, grey = build_splits(from_dict(tiny_raw), ["syn-same"])
    tiny_raw["public"]["channels"] = 3
    tiny_raw["data"]["image_size"] = 20
    with pytest.raises(ConfigError, match=r"tasks\.syn-same: .*set tasks\.syn-same\.channels: 3"):
        validate(tiny_raw)
    for t in tiny_raw["tasks"].values():
        t["channels"] = 3
    plan, roles = build_splits(validate(tiny_raw), ["syn-same"])
    x = roles["syn-same"].train.tensors[0]
    assert plan.in_chans == 3 and x.shape[1:] == (3, 20, 20)
    raw = x * plan.std.view(1, -1, 1, 1) + plan.mean.view(1, -1, 1, 1)
    assert torch.allclose(raw[:, 0], raw[:, 1], atol=1e-5)
    assert torch.allclose(raw[:, 0], raw[:, 2], atol=1e-5)
    # the same examples as the grey run, resized
    assert torch.equal(roles["syn-same"].train.tensors[1], grey["syn-same"].train.tensors[1])
