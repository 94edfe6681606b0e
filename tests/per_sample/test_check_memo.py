"""The self-test's memo (`per_sample.check_memo`): one run per key in a results folder, a recalled
record said so, and every input of the verdict in the key."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch
from noiseless import dp_sgd  # tests/ is on sys.path
from torch import nn

from dpadapter.models import create_model
from dpadapter.per_sample import (
    PerSampleCheckError,
    check_memo,
    conv,
    ghost,
    rules,
    self_test,
    wrap_for_dp,
)
from dpadapter.per_sample.bookkeeping import BookKeepingModule
from dpadapter.settings import ModelConfig

SAMPLE = ((1, 28, 28), torch.float32)


def _cnn(groups: int = 4, seed: int = 0) -> nn.Module:
    return create_model(ModelConfig("cnn-gn", groups, 8), 10, 1, seed=seed)


def _key(model: nn.Module, mode="bk", shape=(1, 28, 28), dtype=torch.float32, examples=8):
    return check_memo.signature(model, mode, shape, dtype, examples)


def test_the_second_model_of_a_folder_recalls_the_first_ones_pass(tmp_path):
    memo = check_memo.memo_path(tmp_path)
    first = wrap_for_dp(_cnn(seed=0), "bk", sample=SAMPLE, check_memo_path=memo)
    assert first.per_sample_check["passed"] and first.per_sample_check["recalled"] is False
    stored = json.loads(open(memo).read())
    assert list(stored) == [first.per_sample_check["memo_key"]]
    # other weights, same architecture: recalled, said so
    second = wrap_for_dp(_cnn(seed=1), "bk", sample=SAMPLE, check_memo_path=memo)
    rec = second.per_sample_check
    assert rec["recalled"] is True and rec["passed"] is True
    assert rec["memo_key"] == first.per_sample_check["memo_key"]
    assert {k: v for k, v in rec.items() if k != "recalled"} == {
        **stored[rec["memo_key"]],
        "memo_key": rec["memo_key"],
    }
    # without a memo the test runs every time
    assert wrap_for_dp(_cnn(seed=1), "bk", sample=SAMPLE).per_sample_check.get("recalled") is None


def test_a_recalled_record_does_not_run_the_test_and_a_miss_runs_it_once(tmp_path):
    memo, model = check_memo.memo_path(tmp_path), _cnn()
    calls = []

    def run():
        calls.append(1)
        return nn.Identity(), {"passed": True, "examples": 8}

    args = (model, lambda: nn.Identity(), "bk", (1, 28, 28), torch.float32, 8, run)
    assert check_memo.run_or_recall(memo, *args)[1]["recalled"] is False
    assert check_memo.run_or_recall(memo, *args)[1]["recalled"] is True
    assert check_memo.run_or_recall(None, *args)[1] == {"passed": True, "examples": 8}
    assert calls == [1, 1]


def test_a_function_patched_at_run_time_is_a_new_key(monkeypatch):
    base = _key(_cnn())
    right = rules.layer_sums
    monkeypatch.setattr(rules, "layer_sums", lambda *a, **k: right(*a, **k))
    assert _key(_cnn()) != base


def test_a_recalled_check_trains_the_same_weights_as_a_run_one(tmp_path):
    memo = check_memo.memo_path(tmp_path)
    wrap_for_dp(_cnn(seed=3), "bk", sample=SAMPLE, check_memo_path=memo)  # stores the key
    weights = []
    for path in (None, memo):  # run, then recalled
        model = _cnn(seed=5)
        wrapped = wrap_for_dp(model, "bk", sample=SAMPLE, check_memo_path=path)
        assert wrapped.per_sample_check["passed"]
        opt = dp_sgd(wrapped, 0.5, 6, lr=0.1, noise=1.0)
        torch.manual_seed(0)
        x, y = torch.randn(6, 1, 28, 28), torch.randint(0, 10, (6,))
        nn.functional.cross_entropy(wrapped(x), y).backward()
        opt.step()
        weights.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*weights, strict=True))


def test_every_input_of_the_verdict_is_in_the_key():
    base = _key(_cnn())
    assert _key(_cnn(seed=9)) == base  # weights are not
    frozen = _cnn()
    frozen.features[0].weight.requires_grad_(False)
    pinned = _cnn()
    pinned.features[1].eval()
    changed = [
        _key(_cnn(), mode="hooks"),
        _key(_cnn(), shape=(1, 32, 32)),
        _key(_cnn(), dtype=torch.float64),
        _key(_cnn(), examples=200),
        _key(_cnn(groups=2)),  # a module's configuration (GroupNorm groups)
        _key(create_model(ModelConfig("cnn-gn", 4, 16), 10, 1, seed=0)),  # shapes
        _key(create_model(ModelConfig("cnn-gn", 4, 8), 7, 1, seed=0)),  # the head's size
        _key(frozen),  # which parameters train
        _key(pinned),  # which modules run in eval
    ]
    assert base not in changed and len(set(changed)) == len(changed)


def test_a_changed_forward_in_a_class_file_is_a_new_key(tmp_path, monkeypatch):
    def load(body: str) -> type:
        name = f"memo_probe_{abs(hash(body))}"
        (tmp_path / f"{name}.py").write_text(
            "import torch\n\nclass Probe(torch.nn.Linear):\n" + textwrap.indent(body, "    ")
        )
        monkeypatch.syspath_prepend(str(tmp_path))
        return __import__(name).Probe

    keys = []
    for body in ("def forward(self, x):\n    return super().forward(x)\n",
                 "def forward(self, x):\n    return super().forward(x) * 2\n"):  # fmt: skip
        model = nn.Sequential(nn.Flatten(), load(body)(4, 3))
        keys.append(_key(model, shape=(4,)))
    assert keys[0] != keys[1]


def test_a_failed_check_is_never_stored_and_a_stored_failure_is_not_trusted(tmp_path, monkeypatch):
    memo = check_memo.memo_path(tmp_path)
    # a wrong closed form (GroupNorm's weight 50 % too large): refused, and nothing is stored
    right = rules.group_norm_folded  # the per-example kernel, fused or not (`norm_fusion`)

    def wrong(module, a, *rest):
        dx, gw, gb = right(module, a, *rest)
        return dx, gw * 1.5, gb

    monkeypatch.setattr(rules, "group_norm_folded", wrong)
    with pytest.raises(PerSampleCheckError):
        wrap_for_dp(_cnn(), "bk", sample=SAMPLE, check_memo_path=memo)
    assert not (tmp_path / ".cache" / check_memo.FILE).exists()


def test_a_stored_record_that_did_not_pass_is_run_again(tmp_path):
    memo = check_memo.memo_path(tmp_path)
    key = _key(_cnn(), examples=8)
    check_memo.remember(memo, key, {"passed": False})
    got = wrap_for_dp(_cnn(), "bk", sample=SAMPLE, check_memo_path=memo)
    assert got.per_sample_check["recalled"] is False and got.per_sample_check["passed"]


def test_the_key_of_a_function_does_not_follow_reference_counts():
    """A closure of a function's nested code alive elsewhere (a model wrapped earlier in the
    process holds `_check_at_first_forward`'s hook) changed `marshal.dumps` of the function, so
    the memo missed in the process that had just filled it (seen under xdist's --dist load:
    tests/algorithms/test_adpalloc.py before this file)."""
    import marshal

    def outer():
        def inner():
            return 1

        return inner

    before, marshalled = check_memo._code_of(outer), marshal.dumps(outer.__code__)
    alive = [outer() for _ in range(3)]
    assert marshal.dumps(outer.__code__) != marshalled  # what the key used to read
    assert check_memo._code_of(outer) == before
    assert all(f() == 1 for f in alive)

    def other():
        def inner():
            return 2

        return inner

    assert check_memo._code_of(other) != before  # a change in the nested code still shows


class Pool(nn.Module):
    """A setting its forward reads that `extra_repr` does not show."""

    def __init__(self, kind: str = "mean"):
        super().__init__()
        self.kind = kind

    def forward(self, x):
        return x.mean(dim=(2, 3)) if self.kind == "mean" else x.amax(dim=(2, 3))


def _small(kind: str = "mean", groups: int = 2, tied: bool = False) -> nn.Module:
    torch.manual_seed(0)
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    if tied:
        b.weight = a.weight
    return nn.Sequential(
        nn.Conv2d(1, 4, 3), nn.GroupNorm(groups, 4), Pool(kind), a, nn.Tanh(), b, nn.Linear(4, 10)
    )


def _frozen_head() -> nn.Module:
    model = _small()
    model[6].requires_grad_(False)
    return model


def _norm_in_eval() -> nn.Module:
    model = _small()
    model[1].eval()
    return model


def _patched(monkeypatch, owner, name, value) -> dict:
    """A change to the process (the call's arguments stay the base's)."""
    monkeypatch.setattr(owner, name, value)
    return {}


def _wrapper(f):
    return lambda *a, **k: f(*a, **k)


BASE = {"mode": "bk", "shape": (1, 8, 8), "dtype": torch.float32, "examples": 8}
# Each input of the verdict, changed from the base (`_small()` and BASE): the call's arguments
# that change, after the changes it made to the process.
CHANGES = {
    # the model's structure
    "a module's configuration": lambda mp: {"model": _small(groups=1)},
    "a setting extra_repr does not show": lambda mp: {"model": _small("max")},
    "tied weights": lambda mp: {"model": _small(tied=True)},
    "channels-last parameters": lambda mp: {
        "model": _small().to(memory_format=torch.channels_last)
    },
    # which parameters train, which modules run in eval, in which dtype
    "the trained set": lambda mp: {"model": _frozen_head()},
    "a module in eval": lambda mp: {"model": _norm_in_eval()},
    "the dtype": lambda mp: {"model": _small().double(), "dtype": torch.float64},
    # the mode and the code that computes it
    "the mode": lambda mp: {"mode": "hooks"},
    "compiled": lambda mp: {"mode": "bk+compile:default"},
    "a per-sample function patched": lambda mp: _patched(
        mp, rules, "layer_sums", _wrapper(rules.layer_sums)
    ),
    "the self-test's second size": lambda mp: _patched(mp, self_test, "SMALL", 3),
    # the physical batch's layout choices
    "the physical batch size": lambda mp: {"examples": 64},
    "the sample shape": lambda mp: {"shape": (1, 9, 9)},
    "im2col or the grouped kernel": lambda mp: _patched(mp, conv, "IM2COL_MAX_IN_CHANNELS", 0),
    "im2col's chunks": lambda mp: _patched(mp, conv, "PATCH_ELEMENTS", 1 << 10),
    "ghost groups' size": lambda mp: _patched(mp, ghost, "MAX_GROUP_ELEMENTS", 1 << 10),
    "the fused GroupNorm backward": lambda mp: _patched(mp, BookKeepingModule, "fuse_norms", False),
}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_each_input_of_the_verdict_runs_the_check_again(change, tmp_path, monkeypatch):
    """The base is stored and recalled; after the change the check runs again, and its verdict
    is then recalled under the new key. Before this test, tied weights, channels-last
    parameters, a setting outside `extra_repr` and every plain-data setting of the package
    (the layout thresholds, `fuse_norms`, the self-test's sizes) recalled the base's verdict."""
    memo = check_memo.memo_path(tmp_path)
    runs = []

    def run():
        runs.append(1)
        return nn.Identity(), {"passed": True}

    def call(**changed):
        a = {"model": _small(), **BASE, **changed}
        key = (a["mode"], a["shape"], a["dtype"], a["examples"])
        return check_memo.run_or_recall(memo, a["model"], nn.Identity, *key, run)[1]["recalled"]

    assert (call(), call()) == (False, True)
    changed = CHANGES[change](monkeypatch)
    assert call(**changed) is False, f"{change}: the base's verdict was recalled"
    assert call(**changed) is True
    assert len(runs) == 2


def test_a_layout_threshold_changed_at_run_time_runs_the_real_check_again(tmp_path, monkeypatch):
    """Through `wrap_for_dp`: the first convolution's per-example gradients from the grouped
    kernel instead of im2col are another code path, tested again, not recalled."""
    memo = check_memo.memo_path(tmp_path)
    sample = ((1, 8, 8), torch.float32)
    first = wrap_for_dp(_small(), "bk", sample=sample, check_memo_path=memo)
    assert first.per_sample_check["recalled"] is False
    assert first.last_plan == {}  # the self-test's plan is not left behind
    monkeypatch.setattr(conv, "IM2COL_MAX_IN_CHANNELS", 0)
    again = wrap_for_dp(_small(), "bk", sample=sample, check_memo_path=memo)
    assert again.per_sample_check["recalled"] is False and again.per_sample_check["passed"]
    assert again.per_sample_check["memo_key"] != first.per_sample_check["memo_key"]
