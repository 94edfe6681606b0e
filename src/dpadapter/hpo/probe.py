"""The linear scaling rule in the paper's own regime (Panda et al. 2024, Sec. 4.2, Alg. 1-3).

A zero-initialised linear classifier (no bias) on frozen, precomputed features of a pre-trained
checkpoint (`features.py`), trained by full-batch DP-GD with heavy-ball momentum:

    g_t = (sum_i clip_C(grad l(x_i, w_t)) + sigma * C * xi_t) / n,   v_t = rho v_{t-1} + g_t,
    w_{t+1} = w_t - lr * v_t,

with n the (public) size of the training split. Every example is used at every step (q = 1):
there is no subsampling, and so no amplification; each step is one Gaussian mechanism of
l2-sensitivity C under add/remove-one neighbours (the clipped sum changes by at most C), and T
steps compose exactly to one Gaussian mechanism with noise multiplier sigma / sqrt(T)
(`accounting._segment_pld` builds that PLD with dp-accounting). This is what the accountant
assumes and what the code does; `ACCOUNTING` is recorded in every output.

The per-example gradient of a bias-free linear softmax head is (p_i - y_i) x_i^T, whose norm is
|p_i - y_i| |x_i|, so clipping and summing is two matrix products and K runs (grid points,
seeds) train in one batched loop. Opacus would compute the same per-sample gradients one run at
a time through hooks; the HPO needs several hundred runs, so this closed form is written here by
hand (it is checked against autograd in the tests).

Stages (one Snakemake rule each, `workflow/rules/hpo_probe.smk`):
- `oracle`: every r of the grid at every budget (sweep and target epsilons), `oracle_seeds`
  training seeds each. Gives the premise check (the best r against epsilon), the grid oracle
  (best mean validation accuracy; its tuning is NOT accounted) and random search as the exact
  expectation over the grid (each r equally likely, training noise averaged over the seeds).
- `seed_run`: one HPO replicate: Algorithm 3's sweeps (r uniform on the grid, T uniform), each
  sweep's winner released by the accounted selection (`hpo.selection`) and, for comparison, by
  the paper's raw argmax (not covered by the guarantee), the line r(eps), and the final run at
  every target budget. Each total is recomputed from the recorded histories with dp-accounting
  PLD and must not exceed its target.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dpadapter.hpo.accounting import Composition, compose, epsilon_of, history_pld
from dpadapter.hpo.selection import SelectionMechanism
from dpadapter.hpo.space import SearchSpace, StepConfig, fit_scaling
from dpadapter.privacy import Segment

VERSION = 1
TOL = 1e-9
ACCOUNTING = (
    "full-batch DP-GD: q = 1 (every example at every step, no subsampling amplification); each "
    "step is a Gaussian mechanism of l2-sensitivity C (sum of clipped per-example gradients, "
    "add/remove-one neighbours) normalised by the public n; T steps compose exactly to one "
    "Gaussian with noise multiplier sigma/sqrt(T); totals: dp-accounting PLD (pessimistic) of "
    "all trials + selections + the final run"
)
_R_STREAM, _SELECTION_STREAM = 1, 3  # the network regime's seed streams (stages.py)
_ORACLE_SEED = 100_000


@dataclass(frozen=True)
class Split:
    x: torch.Tensor  # (n, d) features
    y: torch.Tensor  # (n,) labels


@dataclass(frozen=True)
class ProbeData:
    num_classes: int
    train: Split
    val: Split
    test: Split | None  # None where selection runs: the test split is never handed to it


def load_data(path: Path, with_test: bool) -> ProbeData:
    from dpadapter.hpo.features import load

    p = load(path)

    def split(name: str) -> Split:
        return Split(p[name]["x"].float(), p[name]["y"].long())

    return ProbeData(
        int(p["num_classes"]), split("train"), split("val"), split("test") if with_test else None
    )


# --- privacy -------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=256)
def single_release_sigma(epsilon: float, delta: float) -> float:
    """Smallest (to 0.1 %) noise multiplier of ONE Gaussian release with eps(delta) <= epsilon.

    A T-step full-batch run then uses sigma * sqrt(T): the same PLD, so the same epsilon.
    """
    hi = 1.0
    while _eps_single(hi, delta) > epsilon:
        hi *= 2
        if hi > 1e8:
            raise ValueError(f"no noise level reaches epsilon {epsilon}")
    lo = hi / 2
    while _eps_single(lo, delta) <= epsilon and lo > 1e-4:
        hi, lo = lo, lo / 2
    while hi / lo > 1.001:
        mid = math.sqrt(lo * hi)
        if _eps_single(mid, delta) <= epsilon:
            hi = mid
        else:
            lo = mid
    return hi


def _eps_single(sigma: float, delta: float) -> float:
    return epsilon_of(history_pld([Segment(sigma, 1.0, 1)]), delta)


def run_history(sigma_single: float, steps: int) -> tuple[Segment, ...]:
    """The releases of a T-step full-batch run with the PLD of one release at `sigma_single`."""
    return (Segment(sigma_single * math.sqrt(steps), 1.0, int(steps)),)


def final_sigma(spent: Composition, delta: float, target: float) -> float:
    """Single-release noise of the final run so that spent + final stays within `target`."""
    base = spent.pld()
    if epsilon_of(base, delta) >= target:
        raise ValueError(
            f"trials and selections already spend {epsilon_of(base, delta):.4f} >= {target}; "
            "lower hpo.sweep_epsilons, trials_per_sweep or selection_epsilon"
        )

    def total(s: float) -> float:
        return epsilon_of(compose([base, history_pld([Segment(s, 1.0, 1)])]), delta)

    hi = 1.0
    while total(hi) > target:
        hi *= 2
    lo = hi / 2
    while total(lo) <= target and lo > 1e-4:
        hi, lo = lo, lo / 2
    while hi / lo > 1.001:
        mid = math.sqrt(lo * hi)
        if total(mid) <= target:
            hi = mid
        else:
            lo = mid
    return hi


# --- training ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Run:
    """One full-batch DP-GD run: T steps at lr with per-step noise multiplier sigma."""

    lr: float
    steps: int
    sigma: float
    seed: int


def clipped_grad_sum(
    x: torch.Tensor,
    y1: torch.Tensor,
    w: torch.Tensor,
    clip: float,
    x_norm: torch.Tensor | None = None,
):
    """Sum over examples of per-example gradients clipped to l2 norm `clip`, for K heads.

    x (n, d), y1 (n, c) one-hot, w (K, d, c) -> (K, d, c). Cross-entropy gradient of example i
    for head k is x_i (p_ki - y_i)^T, with norm |x_i| |p_ki - y_i|. The K heads are laid side by
    side as one (d, K c) matrix, so the whole step is two matrix products.
    """
    k, d, c = w.shape
    n = x.shape[0]
    # (K c, n) layout: the softmax runs over a middle dimension, ~20x faster than over a last
    # dimension of size c on CPU.
    z = (w.transpose(1, 2).reshape(k * c, d) @ x.T).view(k, c, n)
    r = torch.softmax(z, dim=1) - y1.T.unsqueeze(0)  # (K, c, n)
    if x_norm is None:
        x_norm = (x * x).sum(1).sqrt()
    norms = (r * r).sum(1).sqrt() * x_norm.unsqueeze(0)  # (K, n); torch.norm is slow here
    r = r * (clip / norms.clamp_min(1e-12)).clamp(max=1.0).unsqueeze(1)
    return (r.reshape(k * c, n) @ x).view(k, c, d).transpose(1, 2)


def train(
    data: Split, num_classes: int, runs: Sequence[Run], momentum: float, clip: float
) -> torch.Tensor:
    """Train K zero-initialised heads in lockstep; head k stops after its own T_k steps."""
    x, y = data.x, data.y
    n, d = x.shape
    k = len(runs)
    y1 = torch.nn.functional.one_hot(y, num_classes).float()
    x_norm = (x * x).sum(1).sqrt()
    w = torch.zeros(k, d, num_classes)
    v = torch.zeros_like(w)
    lr = torch.tensor([r.lr for r in runs]).view(k, 1, 1)
    sig = torch.tensor([r.sigma * clip for r in runs]).view(k, 1, 1)
    steps = torch.tensor([r.steps for r in runs])
    gens = [torch.Generator().manual_seed(10_000 + r.seed) for r in runs]
    for t in range(int(steps.max()) if k else 0):
        active = (steps > t).float().view(k, 1, 1)
        xi = torch.stack([torch.randn(d, num_classes, generator=g) for g in gens])
        g = (clipped_grad_sum(x, y1, w, clip, x_norm) + sig * xi) / n
        v = active * (momentum * v + g) + (1 - active) * v
        w = w - active * lr * v
    return w


@torch.no_grad()
def correct(data: Split, w: torch.Tensor) -> list[int]:
    k, d, c = w.shape
    pred = (w.transpose(1, 2).reshape(k * c, d) @ data.x.T).view(k, c, -1).argmax(1)
    return [int(v) for v in (pred == data.y.unsqueeze(0)).sum(1)]


# --- configuration helpers ---------------------------------------------------------------------
def space_of(cfg) -> SearchSpace:
    h = cfg.hpo
    return SearchSpace(
        h.lr_range[0], h.lr_range[1], h.steps_range[0], h.steps_range[1], h.grid_size
    )


def budgets(cfg) -> list[float]:
    """Every per-run epsilon the oracle trains at: the sweeps' and the targets'."""
    return sorted({*cfg.hpo.sweep_epsilons, *cfg.hpo.target_epsilons})


def _step_dict(c: StepConfig) -> dict:
    return {"r": c.r, "lr": c.lr, "steps": c.steps}


# --- oracle, premise and the exact random-search expectation -----------------------------------
def random_search_expectation(mean_test_by_point: Sequence[float]) -> float:
    """E[test accuracy] of one run at an r drawn uniformly from the grid (Algorithm 3's prior).

    Exact over r (every grid point weighted 1/|grid|); each point's accuracy is its mean over the
    oracle's training seeds.
    """
    vals = list(mean_test_by_point)
    if not vals:
        raise ValueError("empty grid")
    return float(sum(vals) / len(vals))


def premise(best_r: dict[float, float]) -> dict[str, Any]:
    """Does the oracle's best r rise roughly linearly with epsilon? Least-squares line, R^2 and
    Spearman's rank correlation of (eps, best r); 'holds' when the slope is positive, the ranks
    agree (rho >= 0.8) and the line explains most of the variance (R^2 >= 0.8)."""
    from scipy import stats

    eps = sorted(best_r)
    rs = [best_r[e] for e in eps]
    out: dict[str, Any] = {"epsilons": eps, "best_r": rs}
    if len(eps) < 3 or len(set(rs)) < 2:
        out.update(slope=0.0, intercept=float(np.mean(rs)), r2=0.0, spearman=0.0, holds=False)
        return out
    slope, intercept = np.polyfit(eps, rs, 1)
    pred = np.polyval([slope, intercept], eps)
    ss_res = float(np.sum((np.asarray(rs) - pred) ** 2))
    ss_tot = float(np.sum((np.asarray(rs) - np.mean(rs)) ** 2))
    r2 = 1 - ss_res / ss_tot if ss_tot > 0 else 0.0
    rho = float(stats.spearmanr(eps, rs).statistic)
    out.update(
        slope=float(slope),
        intercept=float(intercept),
        r2=float(r2),
        spearman=rho,
        holds=bool(slope > 0 and rho >= 0.8 and r2 >= 0.8),
    )
    return out


def oracle(cfg, features: Path) -> dict[str, Any]:
    """Every grid point at every budget, `oracle_seeds` seeds each (the grid's cost is shown in
    `grid_total_epsilon`, never used to claim anything)."""
    h, delta = cfg.hpo, cfg.privacy.delta
    data = load_data(features, with_test=True)
    space = space_of(cfg)
    points = [space.decompose_max_steps(r) for r in space.grid()]
    seeds = [_ORACLE_SEED + j for j in range(h.oracle_seeds)]
    out: dict[str, Any] = {"version": VERSION, "accounting": ACCOUNTING, "budgets": {}}
    for eps in budgets(cfg):
        s1 = single_release_sigma(eps, delta)
        runs = [Run(c.lr, c.steps, s1 * math.sqrt(c.steps), s) for c in points for s in seeds]
        w = train(data.train, data.num_classes, runs, h.momentum, h.max_grad_norm)
        val, test = correct(data.val, w), correct(data.test, w)
        nv, nt, ns = len(data.val.y), len(data.test.y), len(seeds)
        grid = []
        for j, c in enumerate(points):
            sl = slice(j * ns, (j + 1) * ns)
            hist = run_history(s1, c.steps)
            grid.append(
                {
                    **_step_dict(c),
                    "sigma": hist[0].noise_multiplier,
                    "epsilon": Composition((hist,)).epsilon(delta),
                    "val_accuracy": [v / nv for v in val[sl]],
                    "test_accuracy": [t / nt for t in test[sl]],
                    "mean_val": float(np.mean(val[sl])) / nv,
                    "mean_test": float(np.mean(test[sl])) / nt,
                }
            )
        best = int(np.argmax([g["mean_val"] for g in grid]))  # ties: the smaller r
        rs = random_search_expectation([g["mean_test"] for g in grid])
        out["budgets"][f"{eps:g}"] = {
            "epsilon": eps,
            "grid": grid,
            "best_index": best,
            "best_r": grid[best]["r"],
            "oracle_test": grid[best]["mean_test"],
            "random_search_expected_test": rs,
            "margin": grid[best]["mean_test"] - rs,
            "grid_total_epsilon": Composition(
                tuple(run_history(s1, c.steps) for c in points for _ in seeds)
            ).epsilon(delta),
        }
    out["premise"] = premise({b["epsilon"]: b["best_r"] for b in out["budgets"].values()})
    out["oracle_note"] = (
        "oracle: best grid point by mean validation accuracy over the training seeds, each run at "
        "the whole budget; its tuning cost is NOT accounted (grid_total_epsilon shows it). "
        "random search: exact expectation over the grid, seeds averaged"
    )
    return out


# --- one HPO replicate ----------------------------------------------------------------------------
def _selections(cfg) -> dict[str, SelectionMechanism]:
    """The accounted selection of the config and the paper's raw argmax (not accounted)."""
    h = cfg.hpo
    out = {"raw": SelectionMechanism("none")}
    if h.selection != "none":
        out["accounted"] = SelectionMechanism(
            h.selection, h.selection_epsilon, h.selection_noise_std
        )
    return out


def seed_run(cfg, features: Path, seed: int) -> dict[str, Any]:
    """Algorithm 2 with both selections, at every target budget; totals recomputed and checked."""
    from dpadapter.hpo.stages import trial_seed

    h, delta = cfg.hpo, cfg.privacy.delta
    space = space_of(cfg)
    sel_data = load_data(features, with_test=False)  # the trials and selections see no test split
    rng = np.random.default_rng([seed, _R_STREAM])
    trials, runs = [], []
    for k, eps in enumerate(h.sweep_epsilons):
        s1 = single_release_sigma(eps, delta)
        for i, r in enumerate(space.sample_sweep(rng, h.trials_per_sweep)):
            c = space.decompose_random(r, rng)
            hist = run_history(s1, c.steps)
            run = Run(c.lr, c.steps, hist[0].noise_multiplier, trial_seed(seed, k, i))
            runs.append(run)
            trials.append(
                {
                    "sweep": k,
                    "trial": i,
                    "sweep_epsilon": eps,
                    **_step_dict(c),
                    "sigma": run.sigma,
                    "seed": run.seed,
                    "epsilon": Composition((hist,)).epsilon(delta),
                    "history": [s.__dict__ for s in hist],
                }
            )
    w = train(sel_data.train, sel_data.num_classes, runs, h.momentum, h.max_grad_norm)
    for t, c in zip(trials, correct(sel_data.val, w), strict=True):
        t["val_correct"] = c  # curator-side: only the selection's output leaves this file
    trial_hists = tuple(tuple(Segment(**s) for s in t["history"]) for t in trials)

    out: dict[str, Any] = {
        "version": VERSION,
        "seed": seed,
        "accounting": ACCOUNTING,
        "trials": trials,
        "selections": {},
    }
    finals: list[tuple[str, float, StepConfig, float]] = []
    for name, mech in _selections(cfg).items():
        chosen, releases = [], []
        for k, _eps in enumerate(h.sweep_epsilons):
            idx = [j for j, t in enumerate(trials) if t["sweep"] == k]
            srng = np.random.default_rng([seed, _SELECTION_STREAM, k])
            pick, _ = mech.select([trials[j]["val_correct"] for j in idx], srng)
            chosen.append(idx[pick])
            releases.append(mech.release(len(idx)))
        points = [(trials[j]["sweep_epsilon"], trials[j]["r"]) for j in chosen]
        f = fit_scaling(points, h.fit)
        spent = Composition(trial_hists, tuple(releases))
        per_target = {}
        for target in h.target_epsilons:
            s_f = final_sigma(spent, delta, target)
            predicted = f.predict(target)
            floor = max(r for _, r in f.points) if h.monotone else -math.inf
            r_star = space.clamp(max(predicted, floor))
            c = space.decompose_max_steps(r_star)
            hist = run_history(s_f, c.steps)
            total = Composition((*trial_hists, hist), tuple(releases)).epsilon(delta)
            if mech.accounted and total > target + TOL:
                raise RuntimeError(f"HPO total {total:.4f} > target {target}")
            per_target[f"{target:g}"] = {
                "target_epsilon": target,
                "r_predicted": predicted,
                "r_star": r_star,
                "clamped": r_star != predicted,
                "final": {**_step_dict(c), "sigma": hist[0].noise_multiplier, "seed": seed},
                "final_epsilon": Composition((hist,)).epsilon(delta),
                "history": [s.__dict__ for s in hist],
                # raw: the trials + final only; the selection's use of validation is unaccounted
                "total_epsilon": total,
                "covered_by_guarantee": mech.accounted,
            }
            finals.append((name, target, c, hist[0].noise_multiplier))
        out["selections"][name] = {
            "mechanism": mech.kind,
            "accounted": mech.accounted,
            "chosen_trials": chosen,
            "sweep_best_r": [r for _, r in points],
            "releases": releases,
            "fit": {"kind": f.kind, "slope": f.slope, "intercept": f.intercept},
            "targets": per_target,
            **(
                {}
                if mech.accounted
                else {"label": "paper's raw selection: NOT covered by the guarantee"}
            ),
        }
    # The final runs are the only ones that see the test split, after every choice is made.
    full = load_data(features, with_test=True)
    final_runs = [Run(c.lr, c.steps, sigma, seed) for _, _, c, sigma in finals]
    w = train(full.train, full.num_classes, final_runs, h.momentum, h.max_grad_norm)
    test, val = correct(full.test, w), correct(full.val, w)
    for (name, target, _, _), t, v in zip(finals, test, val, strict=True):
        row = out["selections"][name]["targets"][f"{target:g}"]
        row["test_accuracy"] = t / len(full.test.y)
        row["val_accuracy"] = v / len(full.val.y)
    return out
