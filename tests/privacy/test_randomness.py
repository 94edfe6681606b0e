"""`privacy.randomness`: seeded runs (the default) reproduce; secret runs take every noise draw
and Poisson mask from the OS's cryptographic source, whatever the seed; every metrics.json
says which mode ran."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from scipy import stats

from dpadapter.privacy import randomness
from dpadapter.settings import ConfigError, PrivacyConfig, from_dict


class _Bytes:
    """A stand-in for os.urandom: a fixed byte stream, so that a run's OS draws can be replayed
    (and counted) while everything else stays as it is."""

    def install(self, monkeypatch) -> _Bytes:
        """The OS's bytes as `privacy.randomness` reads them (other libraries that read the OS,
        uuid4 at a first import for one, keep the real source and do not shift the stream)."""
        monkeypatch.setattr(randomness, "os", SimpleNamespace(urandom=self))
        return self

    def __init__(self, seed: int = 0):
        self.rng = np.random.default_rng(seed)
        self.calls = 0

    def __call__(self, n: int) -> bytes:
        self.calls += 1
        return self.rng.bytes(n)


def _fit(cfg, seed: int, max_steps: int = 4, algo: str = "dpsgd"):
    import dpadapter.train.dp_fit as fit
    from dpadapter.data import build_splits, public_train
    from dpadapter.models import create_model
    from dpadapter.settings import ModelConfig
    from dpadapter.train.dp_spec import run_spec

    _, roles = build_splits(cfg, ["syn-same"])
    train = roles["syn-same"].train
    spec = dataclasses.replace(run_spec(cfg, algo, 2.0, len(train)), epochs=1)
    model = create_model(ModelConfig("cnn-gn", 4, 8), 5, 1, seed=0)
    settings = fit.FitSettings.from_config(cfg)
    _, ledger = fit.dp_fit(
        model, train, algo, spec, settings, seed, public=public_train(cfg), max_steps=max_steps
    )
    return model.state_dict(), ledger


def _secret(tiny_raw):
    return from_dict({**tiny_raw, "privacy": {**tiny_raw["privacy"], "randomness": "secret"}})


def test_the_mode_is_validated_and_seeded_is_the_default(tiny_raw):
    from dpadapter.validation.compose import validate

    assert from_dict(tiny_raw).privacy.randomness == "seeded"
    validate({**tiny_raw, "privacy": {"randomness": "secret"}})
    with pytest.raises(ConfigError, match="privacy.randomness"):
        validate({**tiny_raw, "privacy": {"randomness": "urandom"}})
    with pytest.raises(ConfigError, match="privacy.randomness"):
        PrivacyConfig(randomness="urandom")


@pytest.mark.slow  # in-process, too long for `make check`
@pytest.mark.parametrize("algo", ["dpsgd", "gep"])
def test_secret_noise_and_sampling_come_from_the_os_not_the_seed(
    tiny_raw, tiny_cfg, monkeypatch, algo
):
    """Replaying the same OS bytes gives the same run for different seeds (so the seed drives
    none of the mechanism); fresh OS bytes give another run for the same seed."""
    cfg = _secret(tiny_raw)
    runs = []
    for seed in (0, 1):
        urandom = _Bytes().install(monkeypatch)
        runs.append(_fit(cfg, seed, algo=algo))
        assert urandom.calls >= 2 * 4  # a mask and noise per step, at least
    monkeypatch.undo()
    (w0, l0), (w1, l1) = runs
    assert l0.history == l1.history and l0.steps == 4
    for k in w0:
        assert torch.equal(w0[k], w1[k]), k
    w2, _ = _fit(cfg, 0, algo=algo)  # the real OS: another draw
    assert any(not torch.equal(w0[k], w2[k]) for k in w0)


@pytest.mark.slow  # over ~1.5 s: make check's 2 minutes (docs/testing.md)
def test_seeded_runs_are_unchanged_by_the_os(tiny_cfg, monkeypatch):
    """The default mode never reads the OS for its mechanism: the same seed, the same run."""
    w0, _ = _fit(tiny_cfg, 0)
    urandom = _Bytes().install(monkeypatch)
    w1, _ = _fit(tiny_cfg, 0)
    assert urandom.calls == 0
    for k in w0:
        assert torch.equal(w0[k], w1[k]), k


def test_federated_clients_draw_from_the_os_in_secret_mode(monkeypatch):
    from torch.utils.data import TensorDataset

    from dpadapter.federated.simulation import Client, MechanismRun

    data = TensorDataset(torch.randn(200, 3), torch.zeros(200, dtype=torch.long))
    mech = MechanismRun("gaussian", 1.0, 1.0, 0.3, lr=0.1, delta=1e-5, randomness="secret")
    masks = []
    for seed in (0, 1):
        _Bytes().install(monkeypatch)
        masks.append(Client(0, data, mech, seed=seed).sample()[0])
    assert torch.equal(masks[0], masks[1])  # the OS's bytes decide, not the seed
    seeded = dataclasses.replace(mech, randomness="seeded")
    a, b = (Client(0, data, seeded, seed=s).sample()[0] for s in (0, 1))
    assert not torch.equal(a, b)


@pytest.mark.slow  # in-process, too long for `make check`
def test_every_metrics_json_says_which_mode_ran(tiny_raw, tiny_cfg, tmp_path):
    from dpadapter.stages import finetune, pretrain

    pretrain.run(tiny_cfg, "scratch", tmp_path / "pre", None)
    ckpt = tmp_path / "pre" / "model.pt"
    pre = json.loads((tmp_path / "pre" / "metrics.json").read_text())
    assert pre["randomness"]["mode"] == "seeded"
    for cfg, mode in ((tiny_cfg, "seeded"), (_secret(tiny_raw), "secret")):
        finetune.run(cfg, "scratch", "syn-shift", "dpsgd", 2.0, 0, ckpt, tmp_path / mode)
        m = json.loads((tmp_path / mode / "metrics.json").read_text())
        assert m["randomness"] == cfg.privacy.randomness_record()
        assert m["randomness"]["mode"] == mode


@pytest.mark.slow  # over ~1.5 s: make check's 2 minutes (docs/testing.md)
def test_a_secret_run_resumes(tiny_raw, tiny_cfg, tmp_path, monkeypatch):
    """A killed secret run resumes (no generator state is needed) and spends what planned."""
    from dpadapter.stages import finetune, pretrain
    from dpadapter.train.resume import ResumeFile

    cfg = _secret(tiny_raw)
    pretrain.run(cfg, "scratch", tmp_path / "pre", None)
    ckpt = tmp_path / "pre" / "model.pt"
    real = ResumeFile.save

    def save_then_die(self, obj):
        real(self, obj)
        raise KeyboardInterrupt("killed")

    monkeypatch.setattr(ResumeFile, "save", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        finetune.run(cfg, "scratch", "syn-shift", "dpsgd", 2.0, 0, ckpt, tmp_path / "ft")
    monkeypatch.setattr(ResumeFile, "save", real)
    m = finetune.run(cfg, "scratch", "syn-shift", "dpsgd", 2.0, 0, ckpt, tmp_path / "ft")
    assert m["resumed_from_epoch"] == 1
    assert m["privacy"]["steps"] == cfg.finetune.epochs * int(400 / cfg.finetune.batch_size)
    assert m["privacy"]["epsilon"] <= 2.0


def test_the_os_draws_have_the_laws_the_accountant_assumes():
    n = 200_000
    assert stats.kstest(randomness.os_normal(n), "norm").pvalue > 1e-4
    g = randomness.secret_generator()
    ref = torch.zeros(n, dtype=torch.float64)
    lap = randomness.laplace_noise((n,), 2.0, g, ref).numpy()
    assert stats.kstest(lap, "laplace", args=(0.0, 2.0)).pvalue > 1e-4
    noise = randomness.gaussian_noise(3.0, torch.zeros(n), g)
    assert noise.dtype == torch.float32
    assert stats.kstest(noise.double().numpy(), "norm", args=(0.0, 3.0)).pvalue > 1e-4
    kept = int(randomness.poisson_mask(n, 0.05, g).sum())
    assert abs(kept - 0.05 * n) < 5 * (n * 0.05 * 0.95) ** 0.5
    sel = randomness.OSSelectionRandom()
    assert stats.kstest(sel.gumbel(n), "gumbel_r").pvalue > 1e-4
    assert stats.kstest(sel.normal(1.0, 2.0, n), "norm", args=(1.0, 2.0)).pvalue > 1e-4


@pytest.mark.parametrize("std", [0.0, 0.7, 3.0])
def test_a_seeded_draw_is_opacus_draw_to_the_bit(std):
    """Seeded noise comes from the same generator calls as Opacus' `_generate_noise` (which
    allocates a buffer of zeros first and returns it only at std 0): the same values."""
    from opacus.optimizers.optimizer import _generate_noise

    opacus = randomness._opacus_noise() if randomness._OPACUS_NOISE else _generate_noise
    for shape in [(7,), (33, 5), (2, 3, 3, 3)]:
        ref = torch.empty(shape)
        ours = randomness.gaussian_noise(std, ref, torch.Generator().manual_seed(3))
        theirs = opacus(std=std, reference=ref, generator=torch.Generator().manual_seed(3))
        assert torch.equal(ours, theirs) and ours.dtype == theirs.dtype
