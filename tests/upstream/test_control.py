"""The compute-matched control trains exactly as long as DPAdapter, without the perturbation."""

import dataclasses

import torch

from dpadapter.data import build_splits
from dpadapter.models import create_model
from dpadapter.upstream import UPSTREAMS, UpstreamContext

PARAMS = {
    "epochs": 1,
    "max_steps": 5,
    "m1": 64,
    "m2": 16,
    "lr": 0.01,
    "milestones": [],
    "chunk_size": 64,
}


def _ctx(cfg, gamma):
    cfg = dataclasses.replace(cfg, upstream_params={"dpadapter": {**PARAMS, "gamma": gamma}})
    plan, roles = build_splits(cfg, ["public"])
    warm = create_model(cfg.model, 5, plan.in_chans, seed=0)
    return cfg, UpstreamContext(cfg, plan, roles["public"], warm, 0, lambda e, s: None)


def test_control_equals_dpadapter_without_perturbation(tiny_cfg):
    cfg, ctx = _ctx(tiny_cfg, gamma=0.0)
    control = UPSTREAMS["control"]().build(ctx)
    plain = UPSTREAMS["dpadapter"](cfg.upstream_params["dpadapter"]).build(ctx)
    for a, b in zip(control.parameters(), plain.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-6)
    moved = any(
        not torch.equal(a, w)
        for a, w in zip(control.parameters(), ctx.warmup_model.parameters(), strict=True)
    )
    assert moved, "control must actually train"


def test_control_differs_from_perturbed_dpadapter(tiny_cfg):
    cfg, ctx = _ctx(tiny_cfg, gamma=0.5)
    control = UPSTREAMS["control"]().build(ctx)
    perturbed = UPSTREAMS["dpadapter"](cfg.upstream_params["dpadapter"]).build(ctx)
    diff = max(
        (a - b).abs().max().item()
        for a, b in zip(control.parameters(), perturbed.parameters(), strict=True)
    )
    assert diff > 1e-4
