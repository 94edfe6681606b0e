"""The two client-side DP mechanisms of Pretrain-DPFL and their per-client accountants.

Gaussian (sample-level, add/remove-one adjacency, as Opacus): each round the client draws a
Poisson sample of its data with rate q, clips every example's gradient to l2 norm C, sums, adds
N(0, (sigma C)^2) per coordinate and divides by the expected batch size q d_i (Opacus'
DPOptimizer does all of this). One Poisson-subsampled Gaussian per local step is recorded in
the client's `PrivacyLedger`; epsilon comes from the Opacus accountant over the whole history.

Laplace (the paper's Theorem 1, replace-one adjacency with public d_i): each round the client
uses all of its d_i examples, clips every example's gradient to l1 norm C (= xi_1), sums, adds
Lap(noise_multiplier * C) per coordinate and divides by d_i. The clipped sum has l1 sensitivity
2C under replacement, so one release is (2 / noise_multiplier, 0)-DP; with K releases and
noise_multiplier = 2K / epsilon the per-coordinate scale on the mean is 2 K xi_1 / (d_i eps),
Theorem 1's Lap(0, 2 T xi_1 / (d_i eps_i)) with T = K. Composition is basic (pure-DP epsilons
add), which is exact for the worst case of pure DP; `PureDPLedger` records it.

Hand-written because no library has it: the Laplace optimizer (Opacus only has l2 clipping and
Gaussian noise; we subclass its DPOptimizer and replace only the clip and noise phases) and the
pure-DP ledger (a sum). `pure_dp_delta` cross-checks the latter with dp-accounting's PLD.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from opacus.optimizers import DPOptimizer
from opacus.optimizers.optimizer import _check_processed_flag, _mark_as_processed

from dpadapter.per_sample.clip import clip_factors, per_example_norms
from dpadapter.privacy import (
    PrivacyLedger,
    Search,
    Segment,
    calibrate_sigma,
    epsilon_from_history,
    randomness,
    smallest_sigma,
)
from dpadapter.privacy.accounting import EPS_ERROR, accountant_version
from dpadapter.privacy.calibration import KEY_VERSION
from dpadapter.privacy.memo import cached

GAUSSIAN, LAPLACE = "gaussian", "laplace"
MECHANISMS = (GAUSSIAN, LAPLACE)
ADJACENCY = {
    GAUSSIAN: "add/remove one example of the client's data (Opacus' Poisson-sampled Gaussian); "
    "the client sizes d_i are treated as public (normaliser q d_i, server weights d_i / d)",
    LAPLACE: "replace one example of the client's data (Theorem 1); the client sizes d_i are "
    "public (normaliser d_i, server weights d_i / d)",
}
# Per mechanism, the factor kappa with which the add/remove (1) or replace-one (2) sensitivity
# of a clipped sum, and of the estimation statistics, is computed.
SENSITIVITY_FACTOR = {GAUSSIAN: 1.0, LAPLACE: 2.0}


def laplace_noise(shape, scale: float, generator: torch.Generator | None, like: torch.Tensor):
    """Lap(0, scale) i.i.d. (`privacy.randomness`: from the OS for a secret generator)."""
    return randomness.laplace_noise(shape, scale, generator, like)


class LaplaceDPOptimizer(DPOptimizer):
    """DPOptimizer with per-example l1 clipping to `max_grad_norm` and Laplace noise.

    The noise on the clipped sum has scale `noise_multiplier * max_grad_norm` per coordinate
    (the same convention as Opacus' Gaussian std). Everything else (per-sample gradients, the
    skip queue, scaling by the expected batch size, the step hook) is Opacus'.
    """

    def clip_and_accumulate(self):
        grad_samples = self.grad_samples
        if len(grad_samples[0]) == 0:
            factor = torch.zeros((0,), device=grad_samples[0].device)
        else:
            factor = clip_factors(per_example_norms(grad_samples, "l1"), self.max_grad_norm)
        for p in self.params:
            _check_processed_flag(p.grad_sample)
            gs = self._get_flat_grad_sample(p).to(p.dtype)
            grad = torch.einsum("i,i...", factor.to(gs.device, p.dtype), gs)
            p.summed_grad = grad if p.summed_grad is None else p.summed_grad + grad
            _mark_as_processed(p.grad_sample)

    def add_noise(self):
        scale = self.noise_multiplier * self.max_grad_norm
        for p in self.params:
            _check_processed_flag(p.summed_grad)
            noise = laplace_noise(p.summed_grad.shape, scale, self.generator, p.summed_grad)
            p.grad = (p.summed_grad + noise).view_as(p)
            _mark_as_processed(p.summed_grad)


def release_scalars(
    values: list[float],
    sensitivities: list[float],
    mechanism: str,
    noise: float,
    generator: torch.Generator,
    ledger: PrivacyLedger | PureDPLedger,
) -> list[float]:
    """One DP release of m scalars, each with its own sensitivity, by the client's mechanism;
    recorded in the client's `ledger` (the one `make_ledger` gives for `mechanism`).

    - Gaussian: each scalar, divided by its sensitivity, gets N(0, (noise sqrt(m))^2): a
      Gaussian mechanism with joint noise multiplier `noise` on a vector of l2 sensitivity
      sqrt(m); one release, q = 1, composed with training by the accountant.
    - Laplace: each scalar gets Lap(sensitivity * m / noise): m releases, each
      (noise / m, 0)-DP, so (noise, 0)-DP in all by basic composition.

    Noise in float64 from `privacy.randomness` (the OS's source for a secret generator), drawn
    where the generator lives.
    """
    m = len(values)
    if len(sensitivities) != m:
        raise ValueError(f"{m} values, {len(sensitivities)} sensitivities")
    if mechanism == GAUSSIAN:
        z = randomness.standard_normal(m, generator, torch.float64)
        noisy = [
            v + float(zi) * noise * math.sqrt(m) * s
            for v, zi, s in zip(values, z, sensitivities, strict=True)
        ]
        ledger.record(float(noise), 1.0, 1)
    elif mechanism == LAPLACE:
        ref = torch.zeros(m, dtype=torch.float64, device=generator.device)
        z = laplace_noise((m,), 1.0, generator, ref)
        noisy = [
            v + float(zi) * s * m / noise for v, zi, s in zip(values, z, sensitivities, strict=True)
        ]
        ledger.record(m / float(noise), 1.0, m)
    else:
        raise KeyError(f"unknown mechanism {mechanism!r}; known: {MECHANISMS}")
    return noisy


def theorem1_scale(releases: int, xi1: float, d_i: int, epsilon: float) -> float:
    """Pretrain-DPFL Theorem 1: per-coordinate Laplace scale on client i's mean gradient."""
    return 2.0 * releases * xi1 / (d_i * epsilon)


def laplace_noise_multiplier(epsilon: float, releases: int) -> float:
    """noise_multiplier (scale / C on the clipped sum) spending `epsilon` over `releases`."""
    if epsilon <= 0:
        raise ValueError(f"no budget left for training (epsilon {epsilon})")
    return 2.0 * releases / epsilon


class PureDPLedger:
    """Pure-DP releases of one client: Segment(noise_multiplier=scale/sensitivity, 1.0, steps).

    A Laplace release with scale/l1-sensitivity r is (1/r, 0)-DP; pure-DP epsilons compose by
    addition (basic composition), so epsilon() is the sum over the history.
    """

    delta = 0.0
    accountant = "pure-dp basic composition"

    def __init__(self, history: list[Segment] | None = None):
        self.history: list[Segment] = list(history or [])

    def record(self, noise_multiplier: float, sample_rate: float = 1.0, steps: int = 1) -> None:
        if sample_rate != 1.0:
            raise ValueError("the Laplace mechanism here has no subsampling (Theorem 1)")
        if self.history and self.history[-1].noise_multiplier == noise_multiplier:
            last = self.history[-1]
            self.history[-1] = Segment(last.noise_multiplier, 1.0, last.steps + steps)
            return
        self.history.append(Segment(float(noise_multiplier), 1.0, int(steps)))

    @property
    def steps(self) -> int:
        return sum(s.steps for s in self.history)

    def epsilon(self) -> float:
        if any(s.noise_multiplier <= 0 for s in self.history if s.steps):
            return math.inf
        return float(sum(s.steps / s.noise_multiplier for s in self.history))

    def state_dict(self) -> dict[str, Any]:
        return {
            "delta": 0.0,
            "accountant": self.accountant,
            "history": [asdict(s) for s in self.history],
        }


def make_ledger(mechanism: str, delta: float, accountant: str):
    if mechanism == GAUSSIAN:
        return PrivacyLedger(delta, accountant)
    if mechanism == LAPLACE:
        return PureDPLedger()
    raise KeyError(f"unknown mechanism {mechanism!r}; known: {MECHANISMS}")


def pure_dp_delta(history: list[Segment], epsilon: float) -> float:
    """delta(epsilon) of the composed Laplace history by dp-accounting's PLD (independent check).

    For a pure-DP history spending at most `epsilon` this is 0 up to floating point.
    """
    import dp_accounting

    acc = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
    for s in history:
        if s.steps:
            acc.compose(dp_accounting.LaplaceDpEvent(s.noise_multiplier), s.steps)
    return float(acc.get_delta(epsilon))


def gaussian_sigma(
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    accountant: str,
    prior: list[Segment] = (),
    cache: str | Path | None = None,
) -> float:
    """A sigma within 0.5% of the smallest with epsilon(prior + `steps` releases) <= target.

    Without `prior` this is the repository's `calibrate_sigma`. With one (the estimation
    release of the T1 rule) the joint history is accounted: a bisection over sigma using the
    same accountant, starting from the prior-free sigma (a lower bound). Hand-written because
    Opacus calibrates a single segment only.
    """
    base = calibrate_sigma(target_epsilon, delta, sample_rate, steps, accountant, cache)
    prior = [s for s in prior if s.steps]
    if not prior:
        return base
    key = json.dumps(
        ["joint", KEY_VERSION, accountant_version(), target_epsilon, delta, sample_rate, steps]
        + [accountant, EPS_ERROR, [s.as_tuple() for s in prior]]
    )
    joint_cache = None if cache is None else Path(cache).with_name("sigma_joint.json")
    return cached(
        joint_cache,
        key,
        lambda: _joint_sigma(base, prior, target_epsilon, delta, sample_rate, steps, accountant),
    )


def _joint_sigma(
    base: float,
    prior: list[Segment],
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    accountant: str,
) -> float:
    def eps(sigma: float) -> float:
        return epsilon_from_history([*prior, Segment(sigma, sample_rate, steps)], delta, accountant)

    if epsilon_from_history(prior, delta, accountant) >= target_epsilon:
        raise ValueError("the estimation release alone spends the whole budget")
    # The estimate is one release among many, so the joint sigma is barely above `base`:
    # bracket it from there in small steps (each accountant call costs ~0.5 s with PRV).
    search = Search(start=base * 1.01, grow=1.05, low=base, low_follows=True, rel_width=0.005)
    return smallest_sigma(eps, target_epsilon, search)
