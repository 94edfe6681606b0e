"""Privacy checks that any DP algorithm class must pass; each raises AssertionError on failure.

They are functions of the class (not of a registered name) so that test_checks_catch_mutants
can show each one failing on a deliberately broken algorithm.
"""

from __future__ import annotations

import math
from collections import defaultdict

import algo_harness as H
import torch
from scipy import stats
from torch.utils.data import TensorDataset

from dpadapter.algorithms import DPAlgorithm


def _xy(data, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = data.private.tensors
    return x[start : start + n], y[start : start + n]


def check_sensitivity(cls: type[DPAlgorithm], data, n: int = 6) -> None:
    """Each example's contribution to every query is within the declared sensitivity.

    Single-example steps bound each query's per-example contribution, at a small clip bound
    (clipping binds, which is checked, so a missing or loose clip shows) and at a large one
    (nothing is clipped, so e.g. an unclipped-count query shows its other extreme). For the
    step's first query (made at the step's starting weights) the batch's signal must also be the
    sum of the single-example ones, so adding or removing one example moves it by at most the
    bound.
    """
    ratios: dict[str, list[float]] = defaultdict(list)
    singles = []
    for clip in (0.05, 1e3):
        s = H.spec(max_grad_norm=clip, expected_batch_size=n)
        for j in range(n):
            run = H.build(cls, s, public=data.public, sigma=1.0)
            H.logical_step(run, *_xy(data, j, 1))
            (step,) = run.algo.audit
            assert step.releases, f"{cls.name}: a step made no declared release"
            for r in step.releases:
                assert r.signal is not None, f"{cls.name}: release {r.name} not audited"
                norm = float(r.signal.norm())
                assert norm <= r.sensitivity * (1 + 1e-5) + 1e-7, (
                    f"{cls.name}: one example contributes {norm:.6g} to {r.name}, "
                    f"declared sensitivity {r.sensitivity:.6g}"
                )
                ratios[r.name].append(norm / r.sensitivity)
            if clip < 1:
                singles.append(step.releases[0].signal)
    for name, rs in ratios.items():
        assert max(rs) > 0.5, f"{cls.name}: {name} never near its bound; test does not bind"

    s = H.spec(max_grad_norm=0.05, expected_batch_size=n)
    full = H.build(cls, s, public=data.public, sigma=1.0)
    H.logical_step(full, *_xy(data, 0, n))
    first = full.algo.audit[0].releases[0]
    assert torch.allclose(first.signal, torch.stack(singles).sum(0), atol=1e-5, rtol=1e-4), (
        f"{cls.name}: {first.name} is not the sum of per-example contributions"
    )
    nb = H.build(cls, s, public=data.public, sigma=1.0)
    H.logical_step(nb, *_xy(data, 0, n - 1))
    moved = float((first.signal - nb.algo.audit[0].releases[0].signal).norm())
    assert moved <= first.sensitivity * (1 + 1e-5) + 1e-6, (
        f"{cls.name}: removing one example moves {first.name} by {moved:.6g} > "
        f"{first.sensitivity:.6g}"
    )


def check_noise(cls: type[DPAlgorithm], data, steps: int = 50, sigma: float = 0.8) -> None:
    """The noise drawn has the declared std, and the ledger records exactly its joint multiplier.

    The ledger's sigma may not exceed the joint multiplier of the step's queries (else epsilon is
    under-reported), and should equal the configured (calibrated) sigma. Noise is pooled per
    query after dividing by its declared std and tested against N(0, 1) (chi-square on the sum of
    squares, two-sided at p = 1e-4, and the mean); most steps are empty Poisson batches.
    """
    s = H.spec(max_grad_norm=0.5, expected_batch_size=8)
    run = H.build(cls, s, public=data.public, sigma=sigma)
    for t in range(steps):
        if t % 10 == 0:
            H.logical_step(run, *_xy(data, 8 * (t // 10), 8))
        else:
            H.empty_step(run)
    audit = run.algo.audit
    assert len(audit) == steps == run.ledger.steps, "one ledger record per step"
    configured = run.algo.noise_multiplier(0)
    pooled: dict[str, list[torch.Tensor]] = defaultdict(list)
    for step in audit:
        joint = step.joint_noise_multiplier
        assert step.recorded_noise_multiplier <= joint * (1 + 1e-9), (
            f"{cls.name}: ledger records sigma {step.recorded_noise_multiplier:.6g} but the "
            f"step's queries only have joint multiplier {joint:.6g}"
        )
        assert step.recorded_noise_multiplier == _approx(joint), "noise beyond what is recorded"
        assert step.recorded_noise_multiplier == _approx(configured), "not the configured sigma"
        for r in step.releases:
            pooled[r.name].append((r.noise / r.noise_std).double())
    for name, parts in pooled.items():
        z = torch.cat(parts)
        k = z.numel()
        p = float(stats.chi2.cdf(float((z**2).sum()), k))
        assert 1e-4 < p < 1 - 1e-4, (
            f"{cls.name}: {name} noise std is {float(z.std()):.4f} x the declared one "
            f"({k} draws, chi-square p = {p:.2g})"
        )
        assert abs(float(z.mean())) < 4 / math.sqrt(k), f"{cls.name}: {name} noise is biased"


def _approx(x: float):
    import pytest

    return pytest.approx(x, rel=1e-9)


def check_restores_weights(cls: type[DPAlgorithm], data, physical: int = 4) -> int:
    """With lr 0 and sigma 0, logical batches over several physical ones leave weights as is.

    Anything an algorithm adds to the weights (an ascent) must be gone before the update; the
    public DPSAT code fails this with virtual batches. Returns the number of steps checked.
    """
    s = H.spec(max_grad_norm=1.0, expected_batch_size=12)
    run = H.build(cls, s, public=data.public, sigma=0.0, lr=0.0, audit=False)
    if "rho" in run.algo.params:
        run.algo.params["rho"] = 1.0  # a large ascent, so a left-over perturbation shows
    start = run.params
    for t in range(3):
        H.logical_step(run, *_xy(data, 12 * t, 12), physical=physical)
    drift = max(float((a - b).abs().max()) for a, b in zip(start, run.params, strict=True))
    assert drift == 0.0, f"{cls.name}: weights drift by {drift:.3g} at lr 0 and sigma 0"
    return 3


def check_virtual_batches(cls: type[DPAlgorithm], data, physical: int = 5) -> None:
    """A logical batch split into physical batches gives the same update as one batch (sigma 0).

    Catches state that is per physical batch where it must be per logical batch (the ascent
    point, a clip-count, an anchor subspace). In float64, so that only summation order differs.
    """
    s = H.spec(max_grad_norm=0.5, expected_batch_size=12)
    out = []
    for phys in (None, physical):
        run = H.build(
            cls,
            s,
            public=_double(data.public),
            sigma=0.0,
            lr=0.5,
            momentum=0.5,
            audit=False,
            dtype=torch.float64,
        )
        for t in range(3):
            x, y = _xy(data, 12 * t, 12)
            H.logical_step(run, x.double(), y, physical=phys)
        out.append(run.params)
    for a, b in zip(*out, strict=True):
        assert torch.allclose(a, b, atol=1e-10, rtol=1e-8), (
            f"{cls.name}: physical batches of {physical} change the update by "
            f"{float((a - b).abs().max()):.3g}"
        )


def _double(ds: TensorDataset) -> TensorDataset:
    x, y = ds.tensors
    return TensorDataset(x.double(), y)
