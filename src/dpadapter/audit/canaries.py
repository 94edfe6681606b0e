"""One audited training run: canaries in, scores out, through the library's `dp_fit`.

Threat model (white-box, input-space canaries). The auditor picks the model and the canaries;
DP must hold for any of them, so an audit may choose what makes leakage easiest to see:

- model: multinomial logistic regression (one `nn.Linear`) on the private task's flattened
  images, widened by m input coordinates reserved for the canaries;
- canary i: input `scale * e_(d+i)` (zero on every image pixel) with a label drawn by the
  auditor. Its per-example gradient lives in weight column d+i (and the shared bias) and no
  real example touches that column, so the column's total update is "canary i's clipped
  gradient times the times it was sampled, plus the noise" -- the gradient-canary (Dirac
  canary) construction of Steinke et al. realised as real training examples, so it passes
  through the algorithm's Poisson sampling, per-example clipping, noise and ledger unchanged.

Each canary is included independently with probability 1/2; the bits come from a generator
seeded apart from the training seeds and are never handed to training: `dp_fit` sees one
shuffled TensorDataset. The sampling rate is fixed from the expected size (real + m/2), so it
does not depend on the bits either.

Scores (higher = "member"): `whitebox` projects column d+i of (final - initial) weights on the
direction a descent step on canary i moves it, e_y - 1/K; `blackbox` is minus the final model's
loss on the canary (what an attacker with query access gets).
"""

from __future__ import annotations

import dataclasses
import math
import time

import torch
from torch import nn
from torch.utils.data import TensorDataset

from dpadapter.algorithms import ALGORITHMS
from dpadapter.audit.bound import epsilon_lower_bound, guess_counts
from dpadapter.data import build_splits
from dpadapter.settings import Config
from dpadapter.train.dp_fit import FitSettings, dp_fit
from dpadapter.train.dp_spec import run_spec

SCORES = ("whitebox", "blackbox")
PUBLIC_ANCHOR_POOL = 2000  # public images padded for algorithms with public data (GEP)


@dataclasses.dataclass(frozen=True)
class CanarySet:
    """The auditor's secret: which canaries went in, and their labels."""

    members: torch.Tensor  # bool (m,)
    labels: torch.Tensor  # long (m,)
    scale: float

    @property
    def m(self) -> int:
        return len(self.members)


def draw_canaries(m: int, num_classes: int, scale: float, seed: int) -> CanarySet:
    g = torch.Generator().manual_seed(1_000_003 * (seed + 1) + 17)  # apart from dp_fit's
    members = torch.rand(m, generator=g) < 0.5
    labels = torch.randint(num_classes, (m,), generator=g)
    return CanarySet(members, labels, scale)


def canary_inputs(canaries: CanarySet, d: int) -> torch.Tensor:
    x = torch.zeros(canaries.m, d + canaries.m)
    x[:, d:] = torch.eye(canaries.m) * canaries.scale
    return x


def training_set(
    x_real: torch.Tensor, y_real: torch.Tensor, canaries: CanarySet, seed: int
) -> TensorDataset:
    """Real examples (zero in the canary coordinates) plus the included canaries, shuffled."""
    n, d = x_real.shape
    inc = canaries.members.nonzero().flatten()
    x = torch.zeros(n + len(inc), d + canaries.m)
    x[:n, :d] = x_real
    x[n + torch.arange(len(inc)), d + inc] = canaries.scale
    y = torch.cat([y_real, canaries.labels[inc]])
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed + 99))
    return TensorDataset(x[perm], y[perm])


def score_canaries(
    model: nn.Linear, w0: torch.Tensor, canaries: CanarySet, d: int
) -> dict[str, list[float]]:
    k = model.out_features
    delta = (model.weight.detach() - w0)[:, d:]  # (K, m): column i is canary i's coordinate
    u = nn.functional.one_hot(canaries.labels, k).float() - 1.0 / k  # (m, K)
    white = (delta.T * u).sum(1) / u.norm(dim=1)
    with torch.no_grad():
        logits = model(canary_inputs(canaries, d))
        black = -nn.functional.cross_entropy(logits, canaries.labels, reduction="none")
    return {"whitebox": white.tolist(), "blackbox": black.tolist()}


def bounds(
    scores: dict[str, list[float]],
    members: list[bool],
    guesses: tuple[int, ...],
    delta: float,
    confidence: float,
) -> tuple[float, list[dict]]:
    """eps_lb over every (score, k) tried, Bonferroni-corrected so the max stays at `confidence`.

    Each test guesses the top k canaries members and the bottom k non-members. Trying several
    and reporting the best would overstate the bound without the correction.
    """
    m = len(members)
    tests = [(s, k) for s in scores for k in guesses if 2 * k <= m]
    if not tests:
        raise ValueError(f"no guess count k with 2k <= m = {m} in {guesses}")
    alpha = (1 - confidence) / len(tests)
    rows = []
    for s, k in tests:
        r, v = guess_counts(scores[s], members, k, k)
        lb = epsilon_lower_bound(m, r, v, delta, alpha)
        rows.append({"score": s, "k": k, "guesses": r, "correct": v, "epsilon_lb": lb})
    return max(r["epsilon_lb"] for r in rows), rows


def audit_run(cfg: Config, algo_name: str, eps: float, public: TensorDataset | None = None) -> dict:
    """Train once with `algo_name` at target `eps` with canaries; return the audit record."""
    if algo_name not in ALGORITHMS:
        raise KeyError(f"unknown algorithm {algo_name!r}; known: {sorted(ALGORITHMS)}")
    a = cfg.audit
    t0 = time.time()
    task = a.task or next(iter(cfg.tasks))
    algo_cls = ALGORITHMS[algo_name]
    roles_wanted = [task, "public"] if algo_cls.needs_public_data and public is None else [task]
    _, roles = build_splits(cfg, roles_wanted)
    data = roles[task]
    x_real, y_real = data.train.tensors
    if a.n_real is not None:
        x_real, y_real = x_real[: a.n_real], y_real[: a.n_real]
    x_real = x_real.flatten(1)
    n, d = x_real.shape
    canaries = draw_canaries(a.canaries, data.num_classes, a.canary_scale, a.seed)
    train = training_set(x_real, y_real, canaries, a.seed)
    if algo_cls.needs_public_data and public is None:
        xp, yp = roles["public"].train.tensors
        xp, yp = xp[:PUBLIC_ANCHOR_POOL].flatten(1), yp[:PUBLIC_ANCHOR_POOL]
        public = TensorDataset(torch.cat([xp, torch.zeros(len(xp), a.canaries)], 1), yp)
    spec = run_spec(cfg, algo_name, eps, n + a.canaries // 2)
    if a.epochs is not None:
        spec = dataclasses.replace(spec, epochs=a.epochs)
    torch.manual_seed(a.seed)
    model = nn.Linear(d + a.canaries, data.num_classes)
    nn.init.zeros_(model.weight)
    nn.init.zeros_(model.bias)
    w0 = model.weight.detach().clone()
    algo, ledger = dp_fit(
        model, train, algo_name, spec, FitSettings.from_config(cfg), a.seed, public=public
    )
    model.cpu()  # dp_fit may have trained it on a GPU (cfg.device); scoring is on the CPU
    scores = score_canaries(model, w0, canaries, d)
    members = canaries.members.tolist()
    eps_lb, tests = bounds(scores, members, a.guesses, cfg.privacy.delta, a.confidence)
    best = max(tests, key=lambda r: r["epsilon_lb"])
    spent = ledger.epsilon()
    return {
        "algorithm": algo_name,
        "target_epsilon": eps,
        # The epsilon the pipeline would print for this run: recomputed from the ledger.
        "claimed_epsilon": spent,
        "delta": cfg.privacy.delta,
        "epsilon_lb": eps_lb,
        "confidence": a.confidence,
        "canaries": a.canaries,
        "canaries_included": int(canaries.members.sum()),
        "guesses": best["guesses"],
        "correct": best["correct"],
        "best_test": best,
        "tests": tests,
        "noise_multiplier": algo.sigma,
        "steps": ledger.steps,
        "sample_rate": spec.sample_rate,
        "epochs": spec.epochs,
        "n_real": n,
        "task": task,
        "model": f"linear({d}+{a.canaries} -> {data.num_classes})",
        "canary_scale": a.canary_scale,
        "mechanism_note": algo.mechanism_note,
        "wall_time_s": round(time.time() - t0, 2),
        "within_claim": bool(eps_lb <= spent + 1e-9) if math.isfinite(spent) else True,
        # Revealed only now that training is over, so anyone can re-run the analysis.
        "members": members,
        "labels": canaries.labels.tolist(),
        "scores": scores,
    }
