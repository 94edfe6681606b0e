"""FedSGD/FedAvg mechanics: equivalence with centralized SGD, HT and UT, weighting by d_i."""

import pytest
import torch
from fed_helpers import make_data, make_gsm
from torch import nn
from torch.utils.data import TensorDataset

from dpadapter.federated.simulation import Client, Federation, MechanismRun
from dpadapter.models import create_model, get_head_params
from dpadapter.settings import ModelConfig
from dpadapter.train.strategies import get_strategy

NO_CLIP = 1e9


def _plain(seed):
    return create_model(ModelConfig("cnn-gn", 4, 8), num_classes=5, in_chans=1, seed=seed)


def _sgd(model, x, y, lr, steps):
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def _fed(gsm, datasets, mech, strategy="ft", rounds=3, local_steps=1, t1=None, seed=0):
    clients = [Client(i, d, mech, seed) for i, d in enumerate(datasets)]
    schedule = get_strategy(strategy).schedule(rounds, t1=t1)
    return Federation(gsm, clients, schedule, local_steps), clients


def _close(a, b):
    return all(
        torch.allclose(p, q, atol=1e-6, rtol=1e-5)
        for p, q in zip(a.parameters(), b.parameters(), strict=True)
    )


@pytest.mark.parametrize("local_steps", [1, 2])
def test_one_client_without_noise_equals_centralized_sgd(local_steps):
    data = make_data(48)
    model, gsm = make_gsm(0)
    central = _plain(0)  # same seed: same initial weights
    assert _close(model, central)
    mech = MechanismRun("gaussian", NO_CLIP, 0.0, 1.0, lr=0.2, delta=1e-5)
    fed, clients = _fed(gsm, [data], mech, rounds=3, local_steps=local_steps)
    fed.run()
    _sgd(central, *data.tensors, lr=0.2, steps=3 * local_steps)
    assert _close(model, central)
    assert not _close(model, _plain(0))  # it did train
    assert clients[0].ledger.steps == 3 * local_steps


def test_fedsgd_weights_clients_by_data_size():
    """sum_i (d_i/d) mean-gradient_i is the mean gradient over the union: FedSGD with unequal
    clients and no noise is centralized full-batch SGD (a uniform average would not be)."""
    data = make_data(60)
    x, y = data.tensors
    parts = [TensorDataset(x[:12], y[:12]), TensorDataset(x[12:], y[12:])]
    model, gsm = make_gsm(0)
    central = _plain(0)
    mech = MechanismRun("gaussian", NO_CLIP, 0.0, 1.0, lr=0.2, delta=1e-5)
    _fed(gsm, parts, mech, rounds=2)[0].run()
    _sgd(central, x, y, lr=0.2, steps=2)
    assert _close(model, central)


def test_ht_changes_and_noises_only_the_head():
    model, gsm = make_gsm(0)
    head = {id(p) for p in get_head_params(model)}
    n_head = sum(p.numel() for p in get_head_params(model))
    before = {id(p): p.detach().clone() for p in model.parameters()}
    sigma, clip = 3.0, 1.0
    mech = MechanismRun("gaussian", clip, sigma, 0.5, lr=0.1, delta=1e-5)
    fed, clients = _fed(gsm, [make_data(40, 1), make_data(30, 2)], mech, "ht", rounds=4)
    for c in clients:
        c.audit = []
    fed.run()
    for p in model.parameters():
        changed = not torch.equal(p, before[id(p)])
        assert changed == (id(p) in head)
    audit = [a for c in clients for a in c.audit]
    assert len(audit) == 8 and all(a["phase"] == "ht" and a["dim"] == n_head for a in audit)
    noise = torch.cat([a["noise"] for a in audit])
    assert noise.std().item() == pytest.approx(sigma * clip, rel=0.15)  # N(0, (sigma C)^2)
    assert all(r["released_dim"] == n_head for r in fed.trace)


def test_ut_switches_from_head_to_full_at_t1():
    model, gsm = make_gsm(0)
    head = {id(p) for p in get_head_params(model)}
    backbone = [p for p in model.parameters() if id(p) not in head]
    b0 = [p.detach().clone() for p in backbone]
    n_all = sum(p.numel() for p in model.parameters())
    n_head = sum(p.numel() for p in get_head_params(model))
    mech = MechanismRun("gaussian", 1.0, 0.5, 1.0, lr=0.1, delta=1e-5)
    fed, clients = _fed(gsm, [make_data(32)], mech, "ut", rounds=5, t1=2)
    clients[0].audit = []
    moved = []

    def on_round(rec):
        moved.append(any(not torch.equal(p, q) for p, q in zip(backbone, b0, strict=True)))

    fed.run(on_round)
    assert [r["phase"] for r in fed.trace] == ["ht", "ht", "ft", "ft", "ft"]
    assert moved == [False, False, True, True, True]
    assert [a["dim"] for a in clients[0].audit] == [n_head] * 2 + [n_all] * 3
    assert clients[0].ledger.steps == 5


def test_padded_poisson_samples_release_the_same_updates():
    """Clients padding their Poisson samples to one shape (as on CUDA) train exactly as clients
    that do not: padded rows have zero gradient, so clipped sums, noise and updates agree."""
    datasets = [make_data(n, seed=i) for i, n in enumerate((30, 45, 60))]
    mech = MechanismRun("gaussian", 0.05, 0.8, 0.3, lr=0.5, delta=1e-5)  # every example clipped
    out = []
    for pad in (False, True):
        model, gsm = make_gsm(0)
        clients = [Client(i, d, mech, seed=0, pad=pad) for i, d in enumerate(datasets)]
        for c in clients:
            c.audit = []
        shapes: list[int] = []
        hook = model.register_forward_pre_hook(lambda m, a, s=shapes: s.append(len(a[0])))
        fed = Federation(gsm, clients, get_strategy("ft").schedule(4), local_steps=2)
        fed.run()
        hook.remove()
        sizes = [c.pad_to for c in clients]
        out.append((model, clients, shapes, sizes, fed.trace))
    (plain, c0, s0, p0, t0), (padded, c1, s1, p1, t1) = out
    assert p0 == [None] * 3 and all(p is not None for p in p1)
    assert set(s1) <= set(p1) and len(set(s0)) > len(set(s1)), "samples were not padded"
    assert _close(plain, padded)
    assert not _close(plain, _plain(0))
    for a, b in zip(c0, c1, strict=True):
        assert a.ledger.history == b.ledger.history
        for ra, rb in zip(a.audit, b.audit, strict=True):
            assert torch.allclose(ra["noise"], rb["noise"], atol=1e-6)
    for ra, rb in zip(t0, t1, strict=True):
        assert ra["train_loss"] == pytest.approx(rb["train_loss"], rel=1e-5)
