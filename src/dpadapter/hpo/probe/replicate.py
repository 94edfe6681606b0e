"""One HPO replicate of the linear-probe regime (stage `probe-seed`, one per HPO seed).

Algorithm 3's sweeps (r uniform on the grid, T uniform), each sweep's winner released by the
accounted selection (`hpo.selection`) and, for comparison, by the paper's raw argmax (not
covered by the guarantee), the line r(eps), and the final run at every target budget. Each total
is recomputed from the recorded histories with dp-accounting PLD and must not exceed its target.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from dpadapter.hpo.accounting import TOL, Composition, history_of, history_rows
from dpadapter.hpo.probe.dpgd import Run, correct, train
from dpadapter.hpo.probe.features import load_data
from dpadapter.hpo.probe.privacy import (
    ACCOUNTING,
    VERSION,
    final_sigma,
    run_history,
    single_release_sigma,
)
from dpadapter.hpo.seeds import R_STREAM, SELECTION_STREAM, trial_seed
from dpadapter.hpo.selection import SelectionMechanism, selection_of
from dpadapter.hpo.space import StepConfig, fit_scaling, space_of, step_dict
from dpadapter.privacy.randomness import selection_random


def _selections(cfg) -> dict[str, SelectionMechanism]:
    """The accounted selection of the config and the paper's raw argmax (not accounted)."""
    h = cfg.hpo
    out = {"raw": SelectionMechanism("none")}
    if h.selection != "none":
        out["accounted"] = selection_of(cfg)
    return out


def seed_run(cfg, features: Path, seed: int) -> dict[str, Any]:
    """Algorithm 2 with both selections, at every target budget; totals recomputed and checked."""
    h, delta = cfg.hpo, cfg.privacy.delta
    secret = cfg.privacy.randomness == "secret"
    space = space_of(cfg)
    sel_data = load_data(features, with_test=False)  # the trials and selections see no test split
    rng = np.random.default_rng([seed, R_STREAM])
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
                    **step_dict(c),
                    "sigma": run.sigma,
                    "seed": run.seed,
                    "epsilon": Composition((hist,)).epsilon(delta),
                    "history": history_rows(hist),
                }
            )
    w = train(sel_data.train, sel_data.num_classes, runs, h.momentum, h.max_grad_norm, secret)
    for t, c in zip(trials, correct(sel_data.val, w), strict=True):
        t["val_correct"] = c  # curator-side: only the selection's output leaves this file
    trial_hists = tuple(history_of(t["history"]) for t in trials)

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
            srng = selection_random(cfg.privacy.randomness, [seed, SELECTION_STREAM, k])
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
                "final": {**step_dict(c), "sigma": hist[0].noise_multiplier, "seed": seed},
                "final_epsilon": Composition((hist,)).epsilon(delta),
                "history": history_rows(hist),
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
    w = train(full.train, full.num_classes, final_runs, h.momentum, h.max_grad_norm, secret)
    test, val = correct(full.test, w), correct(full.val, w)
    for (name, target, _, _), t, v in zip(finals, test, val, strict=True):
        row = out["selections"][name]["targets"][f"{target:g}"]
        row["test_accuracy"] = t / len(full.test.y)
        row["val_accuracy"] = v / len(full.val.y)
    return out
