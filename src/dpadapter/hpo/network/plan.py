"""The network regime's first stage and the plan every later stage reads (Panda et al. 2024,
Algorithms 1-3, with the whole network fine-tuned by a registered DP algorithm).

`plan` fixes every privacy parameter before any data is read: each trial's (r, lr, T), sampled
from the seed, and its planned sigma; the selection mechanism; the final run's per-run epsilon
e_f, the largest that keeps the PLD composition of all of it within hpo.target_epsilon. It opens
the MLflow parent run that every later job of the replicate is nested under.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from dpadapter.hpo.accounting import Composition, history_of, history_rows
from dpadapter.hpo.network.calibration import calibrate_final_epsilon, final_epsilon_guess
from dpadapter.hpo.network.runner import planned_history, step_spec, task_sizes
from dpadapter.hpo.seeds import R_STREAM, RANDOM_SEARCH_STREAM, trial_seed
from dpadapter.hpo.selection import NOT_ACCOUNTED, selection_of
from dpadapter.hpo.space import space_of, step_dict
from dpadapter.privacy import Segment
from dpadapter.settings import Config

PLAN_VERSION = 1


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def write_json(path: Path, payload: dict) -> None:
    from dpadapter.train.job import write_json

    write_json(path, payload)


def load_plan(cfg: Config, path: Path) -> dict:
    """The plan, refused when it was made by another version or for another budget."""
    plan = read_json(path)
    if plan.get("version") != PLAN_VERSION:
        raise ValueError(f"plan version {plan.get('version')} != {PLAN_VERSION}; rerun hpo_plan")
    if plan["delta"] != cfg.privacy.delta or plan["target_epsilon"] != cfg.hpo.target_epsilon:
        raise ValueError(
            "plan was made for another privacy.delta or hpo.target_epsilon; rerun hpo_plan"
        )
    return plan


def log_to_parent(cfg: Config, parent_run_id: str | None, metrics: dict[str, float]) -> None:
    from dpadapter import tracking
    from dpadapter.ground import distributed

    if distributed.world().writer:  # a job of several processes logs once, from rank 0
        tracking.log_metrics_to(cfg.tracking, cfg.results_dir, parent_run_id, metrics)


def plan(cfg: Config, upstream: str, task: str, algo: str, seed: int, out: Path) -> dict:
    """Every privacy parameter of the HPO, fixed from the config and the seed alone."""
    from dpadapter import tracking
    from dpadapter.train.dp_spec import run_spec

    h = cfg.hpo
    space, mech = space_of(cfg), selection_of(cfg)
    n_train, n_val = task_sizes(cfg, task)
    if n_val == 0:
        raise ValueError(
            f"hpo needs a validation split to score trials: set tasks.{task}.n_val > 0"
        )
    base = run_spec(cfg, algo, h.target_epsilon, n_train)
    delta = cfg.privacy.delta

    rng = np.random.default_rng([seed, R_STREAM])
    sweeps = []
    for k, eps in enumerate(h.sweep_epsilons):
        trials = []
        for i, r in enumerate(space.sample_sweep(rng, h.trials_per_sweep)):
            c = space.decompose_random(r, rng)
            hist = planned_history(algo, step_spec(cfg, algo, eps, n_train, c.steps))
            trials.append(
                {
                    **step_dict(c),
                    "seed": trial_seed(seed, k, i),
                    "planned_history": history_rows(hist),
                }
            )
        sweeps.append(
            {"epsilon": eps, "trials": trials, "selection_release": mech.release(len(trials))}
        )

    spent = Composition(
        tuple(history_of(t["planned_history"]) for s in sweeps for t in s["trials"]),
        tuple(s["selection_release"] for s in sweeps),
    )
    t_max = space.steps_max

    def planned_final(e: float) -> list[Segment]:
        return planned_history(algo, step_spec(cfg, algo, e, n_train, t_max))

    guess = final_epsilon_guess(
        spent, delta, h.target_epsilon, base.sample_rate, t_max, cfg.privacy.accountant
    )
    eps_f, final_hist, total = calibrate_final_epsilon(
        spent, delta, h.target_epsilon, planned_final, guess=guess
    )

    rs_rng = np.random.default_rng([seed, RANDOM_SEARCH_STREAM])
    rs = space.decompose_random(space.sample_r(rs_rng), rs_rng)
    payload: dict[str, Any] = {
        "version": PLAN_VERSION,
        "upstream": upstream,
        "task": task,
        "algorithm": algo,
        "seed": seed,
        "delta": delta,
        "accountant": "dp-accounting PLD (pessimistic), trials as recorded + selections + final",
        "target_epsilon": h.target_epsilon,
        "n_train": n_train,
        "n_val": n_val,
        "sample_rate": base.sample_rate,
        "steps_per_epoch": base.steps_per_epoch,
        "space": {
            "lr_range": [space.lr_min, space.lr_max],
            "steps_range": [space.steps_min, space.steps_max],
            "r_range": [space.r_min, space.r_max],
            "grid": list(space.grid()),
        },
        "fit": h.fit,
        "selection": {
            "mechanism": mech.kind,
            "accounted": mech.accounted,
            **({"epsilon": mech.epsilon} if mech.kind == "exponential" else {}),
            **({"noise_std": mech.noise_std} if mech.kind == "gaussian" else {}),
            **({"assumption": NOT_ACCOUNTED} if not mech.accounted else {}),
        },
        "sweeps": sweeps,
        "final": {
            "epsilon": eps_f,
            "calibrated_steps": t_max,
            "seed": seed,
            "planned_history": history_rows(final_hist),
        },
        "planned_total_epsilon": total,
        "random_search": {**step_dict(rs), "epsilon": h.target_epsilon, "seed": seed},
        "grid": [step_dict(space.decompose_max_steps(r)) for r in space.grid()],
        "grid_epsilon": h.target_epsilon,
    }
    job = tracking.job(
        cfg, "hpo_plan", {"upstream": upstream, "task": task, "algo": algo, "seed": str(seed)}
    )
    with tracking.start_run(
        cfg.tracking,
        run_name=job.name,
        tags={**job.tags, "hpo.role": "parent"},
        results_dir=cfg.results_dir,
        parent=(job.group, job.group_name),
    ) as run:
        run.log_params(
            {
                "target_epsilon": h.target_epsilon,
                "sweep_epsilons": list(h.sweep_epsilons),
                "trials_per_sweep": h.trials_per_sweep,
                "fit": h.fit,
                "selection": mech.kind,
                "lr_range": list(h.lr_range),
                "steps_range": list(h.steps_range),
                "grid_size": h.grid_size,
                "final_epsilon": eps_f,
                "delta": delta,
            }
        )
        run.log_metrics({"planned_total_epsilon": total, "final_epsilon": eps_f})
        payload["parent_run_id"] = run.run_id
    write_json(out, payload)
    return payload
