"""Per-client audit of the federated mechanisms (`dpadapter.federated`): one run per mech x eps.

The canaries live in client 0's data; the other clients hold their Dirichlet share of the real
task data. Training is the federated stage's own simulation (`Client`, `Federation`, the noise
planned by `plan_noise`, one ledger per client), FT on the audit model of `canaries.py`, and
the scores are read from the global model: post-processing of every client's release, so an
epsilon lower bound from them bounds client 0's (sample-level) epsilon.

Adjacency, and why client 0's size is fixed. The stage treats client sizes d_i as public: the
Gaussian client normalises by q*d_i and the server weights by d_i/d. Were d_0 its actual size,
it would depend on the canaries' inclusion bits and leak them outside the audit's theorem. So:

- gaussian (add/remove-one): canary i is present or absent, and client 0 uses the public size
  d_0 = real + m/2 for its normaliser and weight (`FixedSizeClient`; Poisson sampling is over
  the examples actually present);
- laplace (replace-one, Theorem 1): canary i or, in its place, a blank example (all-zero input,
  same label), so d_0 is the same whatever the bits -- exactly the mechanism's adjacency.

Hand-written because the federated stage has no canaries; everything private is its code.
"""

from __future__ import annotations

import time

import torch
from torch import nn
from torch.utils.data import TensorDataset

from dpadapter.audit.canaries import bounds, draw_canaries, score_canaries
from dpadapter.data import build_splits
from dpadapter.federated.mechanisms import GAUSSIAN, LAPLACE
from dpadapter.federated.partition import dirichlet_partition
from dpadapter.federated.simulation import Client, Federation
from dpadapter.federated.stage import mechanism_run, plan_noise
from dpadapter.per_sample import wrap_for_dp
from dpadapter.privacy import randomness
from dpadapter.settings import Config
from dpadapter.train.strategies import get_strategy


class FixedSizeClient(Client):
    """A client whose public size (normaliser q*d_i, server weight d_i/d) is given, not counted."""

    def __init__(self, *args, public_size: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.size = public_size

    def sample(self) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.data.tensors
        mask = randomness.poisson_mask(len(y), self.mech.sample_rate, self.sample_gen)
        return x[mask], y[mask]


def audit_federated_run(cfg: Config, mechanism: str, eps: float) -> dict:
    """Audit client 0 of a federated run with `mechanism` at target `eps`; the audit record."""
    if mechanism not in (GAUSSIAN, LAPLACE):
        raise KeyError(f"unknown mechanism {mechanism!r}")
    a, fed = cfg.audit, cfg.federated
    t0 = time.time()
    task = fed.task or a.task or next(iter(cfg.tasks))
    data = build_splits(cfg, [task])[1][task]
    x, y = data.train.tensors
    x = x.flatten(1)
    n, d = x.shape
    m = a.canaries
    parts = dirichlet_partition(
        y, fed.clients, fed.dirichlet_alpha, fed.split_seed, fed.min_client_size
    )
    canaries = draw_canaries(m, data.num_classes, a.canary_scale, a.seed)
    pad = torch.zeros(n, m)
    xs = torch.cat([x, pad], 1)
    # client 0: its real share plus the canaries (laplace: blanks in the absent ones' places)
    idx0 = parts[0]
    present = canaries.members if mechanism == GAUSSIAN else torch.ones(m, dtype=torch.bool)
    slots = present.nonzero().flatten()
    xc = torch.zeros(len(slots), d + m)
    inc = slots[canaries.members[slots]]  # slots holding a real canary (the rest are blanks)
    xc[(canaries.members[slots]).nonzero().flatten(), d + inc] = canaries.scale
    x0 = torch.cat([xs[idx0], xc])
    y0 = torch.cat([y[idx0], canaries.labels[slots]])
    perm = torch.randperm(len(y0), generator=torch.Generator().manual_seed(a.seed + 99))
    releases = fed.rounds * fed.local_steps
    sigma, _, _ = plan_noise(cfg, mechanism, eps, releases, False)
    mech = mechanism_run(cfg, mechanism, sigma)
    public_size = len(idx0) + (m // 2 if mechanism == GAUSSIAN else m)
    clients = [
        FixedSizeClient(0, TensorDataset(x0[perm], y0[perm]), mech, a.seed, public_size=public_size)
    ]
    clients += [
        Client(i, TensorDataset(xs[idx], y[idx]), mech, a.seed)
        for i, idx in enumerate(parts)
        if i > 0
    ]
    torch.manual_seed(a.seed)
    model = nn.Linear(d + m, data.num_classes)
    nn.init.zeros_(model.weight)
    nn.init.zeros_(model.bias)
    w0 = model.weight.detach().clone()
    gsm = wrap_for_dp(  # the sample's shape only
        model,
        cfg.finetune.grad_sample_mode,
        True,
        ((d + m,), xs.dtype),
        check=cfg.finetune.per_sample_check,
    )
    gsm.train()
    Federation(gsm, clients, get_strategy("ft").schedule(fed.rounds), fed.local_steps).run()
    if hasattr(gsm, "_close"):
        gsm._close()
    model.cpu()
    scores = score_canaries(model, w0, canaries, d)
    members = canaries.members.tolist()
    eps_lb, tests = bounds(scores, members, a.guesses, cfg.privacy.delta, a.confidence)
    best = max(tests, key=lambda r: r["epsilon_lb"])
    spent = clients[0].ledger.epsilon()
    return {
        "algorithm": f"federated-{mechanism}",  # the audit stage's job name
        "target_epsilon": eps,
        "claimed_epsilon": spent,  # client 0's ledger: what the federated stage reports
        "delta": mech.delta,
        "epsilon_lb": eps_lb,
        "confidence": a.confidence,
        "canaries": m,
        "canaries_included": int(canaries.members.sum()),
        "guesses": best["guesses"],
        "correct": best["correct"],
        "best_test": best,
        "tests": tests,
        "noise_multiplier": sigma,
        "steps": clients[0].ledger.steps,
        "sample_rate": mech.sample_rate,
        "clients": len(clients),
        "client0_public_size": public_size,
        "adjacency": "add/remove" if mechanism == GAUSSIAN else "replace-one (canary vs blank)",
        "n_real": n,
        "per_sample_check": gsm.per_sample_check,
        "task": task,
        "model": f"linear({d}+{m} -> {data.num_classes})",
        "canary_scale": a.canary_scale,
        "wall_time_s": round(time.time() - t0, 2),
        "within_claim": bool(eps_lb <= spent + 1e-9),
        "members": members,
        "labels": canaries.labels.tolist(),
        "scores": scores,
    }
