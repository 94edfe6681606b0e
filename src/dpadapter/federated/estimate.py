"""Pretrain-DPFL Steps 2-3: private estimates of G1^2, G2^2, Lambda1^2, Lambda2^2, L, Gamma and T1.

Each client computes, at the initial model theta_0 and with the clipping of its training
mechanism, a few scalar statistics of its per-example gradients over all of its d_i examples:

  a_h = ||P_C(mean_j clip_C(g_j^head))||^2    s_h = mean_j ||clip_C(g_j^head)||^2
  a_f = ||P_C(mean_j clip_C(g_j))||^2         s_f = mean_j ||clip_C(g_j)||^2
  l_k = ||mean_j clip_C(g_j(theta_0 + u_k)) - mean_j clip_C(g_j(theta_0))||   (k = 1..K)

(means over the public client size d_i; clip_C is the training clipping, l2 or l1, followed by
an l2 clipping to `stat_clip` <= C, written C below; P_C projects onto the l2 ball of radius C, a
no-op on the real data that keeps the sensitivity bounded for neighbouring datasets of another
size; u_k are public random directions of norm `radius * ||theta_0||`). Every clipped vector
has l2 norm at most C, so with kappa = 1 (add/remove, Gaussian) or 2
(replace-one, Laplace) the sensitivities are 2 kappa C^2 / d_i (a), C^2 / d_i (s) and
2 kappa C / d_i (l). The client releases the 4 + K scalars once
(`mechanisms.release_scalars`, which records the release in the client's ledger):
- Gaussian: each scalar, divided by its sensitivity, gets N(0, (sigma_e sqrt(4 + K))^2), i.e. a
  Gaussian mechanism with joint noise multiplier sigma_e on a vector of l2 sensitivity sqrt(4+K);
  recorded in the client's ledger as one release (q = 1) and composed with training;
- Laplace: each scalar gets Lap(sensitivity * (4 + K) / eps_e): (eps_e, 0)-DP in all, recorded
  in the client's pure-DP ledger.
Everything after the release is post-processing. Per client (q = Poisson rate, 1 for Laplace):
Lambda^2 = (1 - q) s / (q d_i) (variance of the Poisson-sampled, q d_i-normalised mean gradient),
G^2 = a + Lambda^2 (its second moment), L = mean_k l_k / ||u_k||, Gamma = a_f (an upper bound of
the client's ||grad F_i - grad F||^2 contribution, which Definition 5 allows: the weighted
variance is at most the weighted second moment; Gamma cancels in E1 - E2 anyway). The server
averages each constant with weights d_i / d.

The rule (Theorems 2-3). Both bounds are E0 + E1 T1 + E2 (T - T1) with
  E1 = 4 beta / T^1.5 (L Lambda1^2 / N + 2 L Gamma) + 16 beta^2 L^2 / T^2 (G1^2 + G2^2)
  E2 = 4 beta / T^1.5 (L Lambda2^2 / N + 2 L Gamma) + 8 beta^2 L^2 / T^2 * p * v
where v is the per-coordinate variance of the aggregated noise of one round, sum_i (d_i/d)^2 s_i^2
(s_i the noise std on client i's mean gradient). Substituting the paper's noise gives exactly
its printed C2 (Laplace, Proposition 1: v = 8 T^2 xi1^2 / d^2 sum 1/eps_i^2) and E2 (Gaussian:
v = c2^2 xi2^2 T / d^2 sum log(1/delta_i)/eps_i^2); here v is the noise actually added, so no
unspecified constant c2 is needed (`theorem2_constants` / `theorem3_constants` keep the printed
forms). The bound is linear in T1, so it is minimised at T1 = T (pure HT) when E1 < E2 and at
T1 = 0 (pure FT) otherwise. This follows the algebra and the text after Theorem 3; the sentence
after Theorem 2 states the opposite assignment, which contradicts minimising the bound.
beta = lr * sqrt(T) (the paper's eta = beta / sqrt(T)).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from dpadapter.federated.mechanisms import (
    GAUSSIAN,
    SENSITIVITY_FACTOR,
    PureDPLedger,
    release_scalars,
)
from dpadapter.models import get_head_params
from dpadapter.per_sample.clip import clip_factors, per_example_norms
from dpadapter.privacy import PrivacyLedger
from dpadapter.train.strategies import FT, HT, apply_phase

if TYPE_CHECKING:
    from dpadapter.federated.simulation import MechanismRun

STAT_NAMES = ("a_head", "s_head", "a_full", "s_full")


@dataclass(frozen=True)
class RuleConstants:
    """The six constants of Assumptions 1-2 and Definition 5 (server-side, aggregated)."""

    G1_sq: float
    G2_sq: float
    Lambda1_sq: float
    Lambda2_sq: float
    L: float
    Gamma: float


@dataclass(frozen=True)
class RuleDecision:
    E1: float
    E2: float
    t1: int
    rounds: int
    predicted_best: str
    beta: float
    noise_var: float
    p: int
    n: int
    clients: int
    step_size_condition: bool  # lr < 1 / (2 L) (beta < sqrt(T) / (2 L)), the theorems' assumption
    lr: float = 0.0
    lr_bound: float = math.inf  # 1 / (2 L_check)
    L_check: float = 0.0  # the L the condition is checked with (largest along the trajectory)

    def as_dict(self) -> dict:
        return asdict(self)


def random_directions(params: list[nn.Parameter], k: int, radius: float, seed: int):
    """Public perturbations for the smoothness estimate: k directions of norm radius*||theta||."""
    g = torch.Generator().manual_seed(seed)
    theta_norm = torch.linalg.vector_norm(torch.cat([p.detach().reshape(-1) for p in params]))
    out = []
    for _ in range(k):
        u = [torch.randn(p.shape, generator=g, dtype=p.dtype).to(p.device) for p in params]
        norm = torch.linalg.vector_norm(torch.cat([t.reshape(-1) for t in u]))
        out.append([t * (radius * float(theta_norm) / float(norm)) for t in u])
    return out


def _clipped_sums(gsm, x, y, clip: float, norm: str, chunk: int, with_head: bool, stat_clip: float):
    """Sums over the examples of clipped per-example gradients (full and head-only) and of
    their squared l2 norms. Per-example gradients come from Opacus' GradSampleModule; each is
    clipped as in training (`norm` ball of radius `clip`, the norms and factors of
    `per_sample.clip`, as the clients' optimizers take them), then to `norm` <= `stat_clip`
    (the same unit: l2 for Gaussian, l1 for Laplace)."""
    params = [p for p in gsm.parameters() if p.requires_grad]
    head_ids = {id(p) for p in get_head_params(gsm._module)}
    sum_full = [torch.zeros_like(p) for p in params]
    sum_head = [torch.zeros_like(p) for p in params if id(p) in head_ids]
    sq_full = sq_head = 0.0
    for i in range(0, len(y), chunk):
        for p in params:
            p.grad_sample = None
            p.grad = None
        loss = nn.functional.cross_entropy(gsm(x[i : i + chunk]), y[i : i + chunk])
        loss.backward()
        gs = [p.grad_sample.reshape(p.grad_sample.shape[0], -1) for p in params]
        is_head = [id(p) in head_ids for p in params]
        parts = {"full": list(range(len(params))), "head": [j for j, h in enumerate(is_head) if h]}
        for part, idx in parts.items():
            if part == "head" and not with_head:
                continue
            nrm = per_example_norms([gs[j] for j in idx], norm)
            f = clip_factors(nrm, clip)
            l2sq = torch.stack([gs[j].pow(2).sum(1) for j in idx], 1).sum(1)
            # The statistics' bound is in the training clipping's own unit (l1 for Laplace):
            # the estimate measures the gradients as training clips them. l2 <= l1, so an l1
            # bound c is also the l2 bound the sensitivities use.
            f = f * clip_factors(f * nrm, stat_clip)
            target = sum_full if part == "full" else sum_head
            for t, j in zip(target, idx, strict=True):
                t += (f[:, None] * gs[j]).sum(0).view_as(t)
            if part == "full":
                sq_full += float((f.pow(2) * l2sq).sum())
            else:
                sq_head += float((f.pow(2) * l2sq).sum())
    for p in params:
        p.grad_sample = None
        p.grad = None
    return sum_full, sum_head, sq_full, sq_head


def _project_sq(vecs: list[torch.Tensor], radius: float) -> tuple[float, torch.Tensor]:
    flat = torch.cat([v.reshape(-1) for v in vecs])
    nrm = float(torch.linalg.vector_norm(flat))
    if nrm > radius:
        flat = flat * (radius / nrm)
    return float(flat.pow(2).sum()), flat


def client_statistics(
    gsm,
    data,
    clip: float,
    norm: str,
    directions,
    d_public: int | None = None,
    stat_clip: float | None = None,
    chunk: int = 256,
) -> dict:
    """Raw (not yet private) statistics of one client at the current model; see module doc.

    Means divide by the client's public size `d_public` (default: its number of examples), so
    a neighbouring dataset with one example more or less is normalised by the same constant.
    `stat_clip` (default: `clip`) is the l2 bound the statistics' sensitivities use: l1-clipped
    gradients (Laplace) are far shorter in l2 than their l1 bound, and a tighter l2 bound cuts
    the estimate's noise without changing what it measures much.
    """
    x, y = data.tensors
    d = len(y) if d_public is None else d_public
    stat_clip = clip if stat_clip is None else min(clip, stat_clip)
    apply_phase(gsm, FT)
    params = [p for p in gsm.parameters() if p.requires_grad]
    sum_full, sum_head, sq_full, sq_head = _clipped_sums(
        gsm, x, y, clip, norm, chunk, True, stat_clip
    )
    a_full, mean_full = _project_sq([s / d for s in sum_full], stat_clip)
    a_head, _ = _project_sq([s / d for s in sum_head], stat_clip)
    ells = []
    saved = [p.detach().clone() for p in params]
    try:
        for u in directions:
            with torch.no_grad():
                for p, du in zip(params, u, strict=True):
                    p.add_(du)
            moved, _, _, _ = _clipped_sums(gsm, x, y, clip, norm, chunk, False, stat_clip)
            diff = torch.cat([m.reshape(-1) / d for m in moved]) - mean_full
            ells.append(float(torch.linalg.vector_norm(diff)))
            with torch.no_grad():
                for p, s in zip(params, saved, strict=True):
                    p.copy_(s)
    finally:
        with torch.no_grad():
            for p, s in zip(params, saved, strict=True):
                p.copy_(s)
    return {
        "a_head": a_head,
        "s_head": sq_head / d,
        "a_full": a_full,
        "s_full": sq_full / d,
        "ell": ells,
    }


def sensitivities(mechanism: str, clip: float, d_i: int, k: int) -> list[float]:
    """Sensitivity of each released scalar (a_h, s_h, a_f, s_f, l_1..l_k); see module doc.

    `clip` is the l2 bound of the clipped per-example vectors (`stat_clip`)."""
    kappa = SENSITIVITY_FACTOR[mechanism]
    c2 = clip * clip
    return [2 * kappa * c2 / d_i, c2 / d_i, 2 * kappa * c2 / d_i, c2 / d_i] + [
        2 * kappa * clip / d_i
    ] * k


def privatize(
    raw: dict,
    mechanism: str,
    clip: float,
    d_i: int,
    noise: float,
    generator: torch.Generator,
    ledger: PrivacyLedger | PureDPLedger,
) -> dict:
    """Noisy statistics, released once by the client's mechanism (`mechanisms.release_scalars`)
    and recorded in its `ledger`.

    `noise` is the joint Gaussian noise multiplier sigma_e (Gaussian) or the pure-DP epsilon
    eps_e of the whole release (Laplace).
    """
    values = [raw[k] for k in STAT_NAMES] + list(raw["ell"])
    sens = sensitivities(mechanism, clip, d_i, len(raw["ell"]))
    noisy = release_scalars(values, sens, mechanism, noise, generator, ledger)
    out = dict(zip(STAT_NAMES, noisy[:4], strict=True))
    out["ell"] = noisy[4:]
    return out


def client_constants(noisy: dict, d_i: int, sample_rate: float, direction_norms: list[float]):
    """Post-processing of one client's noisy statistics into its six constants (clamped >= 0)."""
    pos = lambda v: max(0.0, float(v))  # noqa: E731
    var = (1.0 - sample_rate) / (sample_rate * d_i)
    lam1 = var * pos(noisy["s_head"])
    lam2 = var * pos(noisy["s_full"])
    ell = [pos(v) / r for v, r in zip(noisy["ell"], direction_norms, strict=True)]
    return RuleConstants(
        G1_sq=pos(noisy["a_head"]) + lam1,
        G2_sq=pos(noisy["a_full"]) + lam2,
        Lambda1_sq=lam1,
        Lambda2_sq=lam2,
        L=sum(ell) / len(ell) if ell else 0.0,
        Gamma=pos(noisy["a_full"]),
    )


def aggregate_constants(per_client: list[RuleConstants], sizes: list[int]) -> RuleConstants:
    """Server side: the d_i/d-weighted mean of each constant."""
    d = sum(sizes)
    fields = RuleConstants.__dataclass_fields__
    return RuleConstants(
        **{
            f: sum(getattr(c, f) * n / d for c, n in zip(per_client, sizes, strict=True))
            for f in fields
        }
    )


def aggregated_noise_var(
    mechanism: str, sizes: list[int], clip: float, noise_multiplier: float, sample_rate: float
) -> float:
    """Per-coordinate variance of the d_i/d-weighted sum of the clients' noise in one round."""
    d = sum(sizes)
    if mechanism == GAUSSIAN:
        per = [(noise_multiplier * clip / (sample_rate * n)) ** 2 for n in sizes]
    else:
        per = [2.0 * (noise_multiplier * clip / n) ** 2 for n in sizes]
    return sum((n / d) ** 2 * v for n, v in zip(sizes, per, strict=True))


def rule_terms(c: RuleConstants, T: int, N: int, beta: float, p: int, noise_var: float):
    """(E1, E2) of Theorem 3 (= C1, C2 of Theorem 2) with the noise actually added."""
    common = 4 * beta / T**1.5
    e1 = common * (c.L * c.Lambda1_sq / N + 2 * c.L * c.Gamma) + 16 * beta**2 * c.L**2 / T**2 * (
        c.G1_sq + c.G2_sq
    )
    e2 = common * (c.L * c.Lambda2_sq / N + 2 * c.L * c.Gamma) + 8 * beta**2 * c.L**2 / T**2 * (
        p * noise_var
    )
    return e1, e2


def decide(
    c: RuleConstants,
    T: int,
    N: int,
    lr: float,
    p: int,
    n: int,
    noise_var: float,
    L_check: float | None = None,
) -> RuleDecision:
    """T1 minimising E0 + E1 T1 + E2 (T - T1): T (HT) if E1 < E2, else 0 (FT).

    Theorems 2-3 assume the step size eta = beta / sqrt(T) = lr is below 1 / (2 L);
    `step_size_condition` says whether it is, for `L_check` (default c.L; the stage passes the
    largest L estimated along the trajectory). When it does not hold the bound, and so the
    rule, is outside its theorem: the decision is still returned and the stage reports it.
    """
    beta = lr * math.sqrt(T)
    e1, e2 = rule_terms(c, T, N, beta, p, noise_var)
    t1 = T if e1 < e2 else 0
    lc = c.L if L_check is None else float(L_check)
    bound = math.inf if lc <= 0 else 1.0 / (2.0 * lc)
    return RuleDecision(
        E1=e1,
        E2=e2,
        t1=t1,
        rounds=T,
        predicted_best=HT if t1 == T else FT,
        beta=beta,
        noise_var=noise_var,
        p=p,
        n=n,
        clients=N,
        step_size_condition=bool(lr < bound),
        lr=lr,
        lr_bound=bound,
        L_check=lc,
    )


def trajectory_constants(points: list[RuleConstants]) -> RuleConstants:
    """Constants over the estimation points along the trajectory: the mean of each.

    The theorems' constants bound quantities over every iterate; one estimate at theta_0 sees
    only the start. The mean over points keeps each estimate's noise from dominating; the
    step-size check uses the largest L (`decide(L_check=...)`), the conservative reading.
    """
    if not points:
        raise ValueError("no estimation points")
    fields = RuleConstants.__dataclass_fields__
    return RuleConstants(**{f: sum(getattr(c, f) for c in points) / len(points) for f in fields})


def rule_decision(
    points: list[RuleConstants],
    rounds: int,
    sizes: list[int],
    mech: MechanismRun,
    dims: dict[str, int],
) -> tuple[RuleDecision, RuleConstants]:
    """Theorems 2-3 on the constants averaged along the trajectory; the step-size assumption
    checked with the largest L estimated.

    The theorems' dimensions come from the model's releases (`strategies.released_dims`): n is
    what HT releases (the head), p the coordinates FT releases on top of it, so FT's extra noise
    term is p times the per-coordinate variance. N is the number of clients, whose sizes weight
    the noise variance."""
    consts = trajectory_constants(points)
    v = aggregated_noise_var(
        mech.name, sizes, mech.max_grad_norm, mech.noise_multiplier, mech.sample_rate
    )
    decision = decide(
        consts,
        rounds,
        len(sizes),
        mech.lr,
        dims["ft"] - dims["ht"],
        dims["ht"],
        v,
        L_check=max(c.L for c in points),
    )
    return decision, consts


def theorem2_constants(c: RuleConstants, T, N, beta, p, xi1, d, epsilons):
    """(C1, C2) exactly as printed in Theorem 2 (Laplace)."""
    s = sum(1 / e**2 for e in epsilons)
    common = 4 * beta / T**1.5
    c1 = common * (c.L * c.Lambda1_sq / N + 2 * c.L * c.Gamma) + 16 * beta**2 * c.L**2 / T**2 * (
        c.G1_sq + c.G2_sq
    )
    c2 = (
        common * (c.L * c.Lambda2_sq / N + 2 * c.L * c.Gamma)
        + 64 * beta**2 * c.L**2 * p * xi1**2 / d**2 * s
    )
    return c1, c2


def theorem3_constants(c: RuleConstants, T, N, beta, p, xi2, d, epsilons, deltas, c2):
    """(E1, E2) exactly as printed in Theorem 3 (Gaussian), with the unspecified constant c2."""
    s = sum(math.log(1 / dl) / e**2 for e, dl in zip(epsilons, deltas, strict=True))
    common = 4 * beta / T**1.5
    e1 = common * (c.L * c.Lambda1_sq / N + 2 * c.L * c.Gamma) + 16 * beta**2 * c.L**2 / T**2 * (
        c.G1_sq + c.G2_sq
    )
    e2 = common * (c.L * c.Lambda2_sq / N + 2 * c.L * c.Gamma) + 8 * beta**2 * c.L**2 / T**2 * (
        c2**2 * p * xi2**2 * T / d**2 * s
    )
    return e1, e2


__all__ = [
    "HT",
    "FT",
    "RuleConstants",
    "RuleDecision",
    "aggregate_constants",
    "aggregated_noise_var",
    "client_constants",
    "client_statistics",
    "decide",
    "privatize",
    "random_directions",
    "rule_decision",
    "rule_terms",
    "sensitivities",
    "theorem2_constants",
    "theorem3_constants",
    "trajectory_constants",
]
