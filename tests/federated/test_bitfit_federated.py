"""BiTFiT in the federated stage: a round moves the biases and the head only, and a job's
metrics.json says what it released."""

import pytest
import torch
from fed_helpers import make_data, make_gsm

from dpadapter.federated.simulation import Client, Federation, MechanismRun
from dpadapter.models import get_head_params
from dpadapter.settings import from_dict
from dpadapter.train.strategies import get_strategy


def _bitfit_names(model) -> set[str]:
    head = {id(p) for p in get_head_params(model)}
    return {n for n, p in model.named_parameters() if id(p) in head or n.endswith(".bias")}


def test_bitfit_rounds_move_biases_and_head_only():
    model, gsm = make_gsm(0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    mech = MechanismRun("gaussian", 1.0, 0.5, 0.5, lr=0.2, delta=1e-5)
    clients = [Client(i, make_data(40, seed=i), mech, 0) for i in range(2)]
    trace = Federation(gsm, clients, get_strategy("bitfit").schedule(2)).run()
    assert [r["phase"] for r in trace] == ["bitfit", "bitfit"]
    # cnn-gn width 8, 5 classes: conv biases 28 + GroupNorm biases 28 + head 85
    assert {r["released_dim"] for r in trace} == {141}
    moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert moved == _bitfit_names(model)
    assert all(c.ledger.steps == 2 for c in clients)


@pytest.fixture
def fed_bitfit(tiny_raw, tiny_cfg, tmp_path):
    from dpadapter.stages import pretrain

    fed = {
        "task": "syn-shift",
        "clients": 3,
        "min_client_size": 20,
        "rounds": 2,
        "seeds": [0],
        "strategies": ["ft", "bitfit"],
        "rounds_sweep": [],
        "eval_every": 1,
        "gaussian": {"epsilons": [2.0], "max_grad_norm": 1.0, "lr": 0.5, "sample_rate": 0.5},
    }
    raw = {**tiny_raw, "federated": fed, "privacy": {"delta": 1e-5, "accountant": "rdp"}}
    cfg = from_dict(raw)
    pretrain.run(cfg, "scratch", tmp_path / "pre", None)
    return cfg, tmp_path / "pre" / "model.pt"


@pytest.mark.slow  # in-process, too long for `make check`
def test_bitfit_job_records_its_releases(fed_bitfit, tmp_path):
    from dpadapter.federated import stage

    cfg, ckpt = fed_bitfit
    assert ("sam", "bitfit", "gaussian", 2.0, 2, 0) in cfg.federated.jobs(("scratch", "sam"))
    m = stage.run(cfg, "scratch", "bitfit", "gaussian", 2.0, 2, 0, ckpt, tmp_path / "b")
    s = m["schedule"]
    assert s["phases"] == [{"phase": "bitfit", "start": 0, "steps": 2}]
    assert s["t1"] == 0 and s["t1_source"] == "fixed"
    dims = s["released_dims"]
    assert set(dims) == {"ht", "ft", "bitfit"}
    assert dims["ht"] < dims["bitfit"] < dims["ft"]
    assert [c["phase"] for c in m["curve"]] == ["bitfit", "bitfit"]
    assert {c["released_dim"] for c in m["curve"]} == {dims["bitfit"]}
    assert m["hyperparameters"]["effective_strategy"] == "bitfit"
    assert m["rule"] is None and m["predicted_best"] is None
    assert m["privacy"]["epsilon"] <= 2.0 * 1.001
    # ft's metrics keep their keys: HT's and FT's dimensions only
    f = stage.run(cfg, "scratch", "ft", "gaussian", 2.0, 2, 0, ckpt, tmp_path / "f")
    assert set(f["schedule"]["released_dims"]) == {"ht", "ft"}
    assert f["schedule"]["released_dims"]["ft"] == dims["ft"]
