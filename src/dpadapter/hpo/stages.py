"""The HPO stages (one Snakemake rule each), Algorithms 1-3 of Panda et al. (2024).

plan         fixes every privacy parameter before any data is read: each trial's (r, lr, T),
             sampled from the seed, and its planned sigma; the selection mechanism; the final
             run's per-run epsilon e_f, the largest that keeps the PLD composition of all of it
             within hpo.target_epsilon. Opens the MLflow parent run.
trial        one trial of a sweep: T steps at the sweep's epsilon, scored by its count of
             correct predictions on the validation split (carved from private training data).
sweep        releases the sweep's best trial through the selection mechanism.
fit          the line (or quadratic) r(eps) through the sweeps' released best r; r* = r(e_f),
             clamped to the grid and decomposed into (lr, T).
final        trains at e_f with r*, checks the composed total again from the recorded
             histories, and evaluates on the test split (the only HPO stage that reads it).
random_search / grid_run / grid_oracle: the baselines (Sec. 5.2.3).

Each training job is its own MLflow run tagged `mlflow.parentRunId` = the plan's run.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from dpadapter.config import Config
from dpadapter.hpo.accounting import (
    Composition,
    calibrate_final_epsilon,
    final_epsilon_guess,
    is_prefix,
)
from dpadapter.hpo.runner import (
    count_correct,
    planned_history,
    private_data,
    step_spec,
    strategy_of,
    task_sizes,
    train_config,
)
from dpadapter.hpo.selection import NOT_ACCOUNTED, SelectionMechanism
from dpadapter.hpo.space import SearchSpace, StepConfig, fit_scaling
from dpadapter.privacy import Segment

PLAN_VERSION = 1
TOL = 1e-9  # float slack when comparing a recomputed epsilon with its target

# Seed streams: all derived from the HPO seed, never from data.
_R_STREAM, _RANDOM_SEARCH_STREAM, _SELECTION_STREAM = 1, 2, 3


def space_of(cfg: Config) -> SearchSpace:
    h = cfg.hpo
    return SearchSpace(
        h.lr_range[0], h.lr_range[1], h.steps_range[0], h.steps_range[1], h.grid_size
    )


def selection_of(cfg: Config) -> SelectionMechanism:
    h = cfg.hpo
    return SelectionMechanism(h.selection, h.selection_epsilon, h.selection_noise_std)


def trial_seed(seed: int, sweep: int, index: int) -> int:
    """Training seed of a trial: distinct from the final-budget runs' (which use `seed`)."""
    return 1000 * (seed + 1) + 100 * (sweep + 1) + index


def _hist(rows: list[dict]) -> tuple[Segment, ...]:
    return tuple(Segment(**r) for r in rows)


def _rows(hist) -> list[dict]:
    return [
        dict(noise_multiplier=s.noise_multiplier, sample_rate=s.sample_rate, steps=s.steps)
        for s in hist
    ]


def _read(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def _write(path: Path, payload: dict) -> None:
    from dpadapter.stages.job import write_json

    write_json(path, payload)


def _step(d: dict) -> StepConfig:
    return StepConfig(lr=float(d["lr"]), steps=int(d["steps"]))


def _step_dict(c: StepConfig) -> dict:
    return {"r": c.r, "lr": c.lr, "steps": c.steps}


def _check_plan(cfg: Config, plan: dict) -> None:
    if plan.get("version") != PLAN_VERSION:
        raise ValueError(f"plan version {plan.get('version')} != {PLAN_VERSION}; rerun hpo_plan")
    if plan["delta"] != cfg.privacy.delta or plan["target_epsilon"] != cfg.hpo.target_epsilon:
        raise ValueError(
            "plan was made for another privacy.delta or hpo.target_epsilon; rerun hpo_plan"
        )


# --- MLflow ------------------------------------------------------------------------------------
def _log_to_parent(cfg: Config, parent_run_id: str | None, metrics: dict[str, float]) -> None:
    from dpadapter import tracking

    tracking.log_metrics_to(cfg.tracking, cfg.results_dir, parent_run_id, metrics)


# --- plan --------------------------------------------------------------------------------------
def plan(cfg: Config, upstream: str, task: str, algo: str, seed: int, out: Path) -> dict:
    """Every privacy parameter of the HPO, fixed from the config and the seed alone."""
    from dpadapter import tracking
    from dpadapter.stages.finetune import run_spec

    h = cfg.hpo
    space, mech = space_of(cfg), selection_of(cfg)
    n_train, n_val = task_sizes(cfg, task)
    if n_val == 0:
        raise ValueError(
            f"hpo needs a validation split to score trials: set tasks.{task}.n_val > 0"
        )
    base = run_spec(cfg, algo, h.target_epsilon, n_train)
    delta = cfg.privacy.delta

    rng = np.random.default_rng([seed, _R_STREAM])
    sweeps = []
    for k, eps in enumerate(h.sweep_epsilons):
        trials = []
        for i, r in enumerate(space.sample_sweep(rng, h.trials_per_sweep)):
            c = space.decompose_random(r, rng)
            hist = planned_history(algo, step_spec(cfg, algo, eps, n_train, c.steps))
            trials.append(
                {**_step_dict(c), "seed": trial_seed(seed, k, i), "planned_history": _rows(hist)}
            )
        sweeps.append(
            {"epsilon": eps, "trials": trials, "selection_release": mech.release(len(trials))}
        )

    spent = Composition(
        tuple(_hist(t["planned_history"]) for s in sweeps for t in s["trials"]),
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

    rs_rng = np.random.default_rng([seed, _RANDOM_SEARCH_STREAM])
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
            "planned_history": _rows(final_hist),
        },
        "planned_total_epsilon": total,
        "random_search": {**_step_dict(rs), "epsilon": h.target_epsilon, "seed": seed},
        "grid": [_step_dict(space.decompose_max_steps(r)) for r in space.grid()],
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
    _write(out, payload)
    return payload


# --- trial -------------------------------------------------------------------------------------
def trial(cfg: Config, plan_path: Path, sweep: int, index: int, ckpt: Path, out_dir: Path) -> dict:
    """One trial; only the training and validation splits are loaded."""
    from dpadapter.stages.job import training_job

    p = _read(plan_path)
    _check_plan(cfg, p)
    t = p["sweeps"][sweep]["trials"][index]
    eps = float(p["sweeps"][sweep]["epsilon"])
    data = private_data(cfg, p["task"])
    wildcards = {
        "upstream": p["upstream"],
        "task": p["task"],
        "algo": p["algorithm"],
        "seed": str(p["seed"]),
        "sweep": str(sweep),
        "trial": str(index),
    }
    with training_job(cfg, "hpo_trial", wildcards, out_dir, parent_run_id=p["parent_run_id"]) as (
        run,
        metrics,
    ):
        run.set_tags({"hpo.role": "trial"})
        res = train_config(
            cfg, data.train, data.num_classes, ckpt, p["algorithm"], _step(t), eps, t["seed"]
        )
        recorded = tuple(res.ledger.history)
        if not is_prefix(recorded, _hist(t["planned_history"])) or res.ledger.steps != t["steps"]:
            raise RuntimeError("the trial's releases differ from its plan; rerun hpo_plan")
        correct = count_correct(res.model, data.val)
        spent = res.ledger.epsilon()
        if spent > eps * (1 + 1e-3):
            raise RuntimeError(f"trial spent epsilon {spent:.4f} > its target {eps}")
        hyper = {
            **res.algorithm.describe(),
            **_step_dict(_step(t)),
            "seed": t["seed"],
            "momentum": cfg.finetune.momentum,
            "strategy": strategy_of(cfg).name,
            "expected_batch_size": res.spec.expected_batch_size,
            "max_grad_norm": res.spec.max_grad_norm,
            "n_train": len(data.train),
        }
        run.log_params(hyper)
        run.log_metrics({"epsilon": spent, "steps": res.ledger.steps, "r": t["r"]})
        metrics.update(
            {
                "hpo": {
                    "role": "trial",
                    "parent_run_id": p["parent_run_id"],
                    "sweep": sweep,
                    "trial": index,
                    "sweep_epsilon": eps,
                    **_step_dict(_step(t)),
                },
                # Raw statistic of private data, kept curator-side (this file) for the selection
                # job; not logged as an MLflow metric, never in hpo.csv/md. Only the selection
                # mechanism's output (hpo_sweep) leaves the curator.
                "val_correct": correct,
                "val_size": len(data.val),
                "hyperparameters": hyper,
                "privacy": {
                    "mechanism": "gaussian",
                    "accountant": res.spec.accountant,
                    "target_epsilon": eps,
                    "epsilon": spent,
                    "delta": res.spec.delta,
                    "steps": res.ledger.steps,
                    "sample_rate": res.spec.sample_rate,
                    "sampling": "poisson",
                    "history": res.ledger.state_dict()["history"],
                    "validation_use": "val_correct is the score of the sweep's private selection "
                    "(hpo_sweep), whose cost is composed into the HPO total",
                },
            }
        )
    return metrics


# --- sweep -------------------------------------------------------------------------------------
def sweep(
    cfg: Config, plan_path: Path, sweep_index: int, trial_paths: list[Path], out: Path
) -> dict:
    """Release the sweep's best trial through the selection mechanism (Algorithm 3)."""
    p = _read(plan_path)
    _check_plan(cfg, p)
    spec = p["sweeps"][sweep_index]
    ms = [_read(x) for x in trial_paths]
    by_index = {m["hpo"]["trial"]: m for m in ms}
    n = len(spec["trials"])
    if (
        len(ms) != n
        or sorted(by_index) != list(range(n))
        or any(m["hpo"]["sweep"] != sweep_index for m in ms)
    ):
        raise ValueError(f"sweep {sweep_index}: need each of its {len(spec['trials'])} trials once")
    ordered = [by_index[i] for i in range(len(spec["trials"]))]
    mech = selection_of(cfg)
    rng = np.random.default_rng([p["seed"], _SELECTION_STREAM, sweep_index])
    chosen, published = mech.select([m["val_correct"] for m in ordered], rng)
    release = mech.release(len(ordered))
    if release != spec["selection_release"]:
        raise ValueError("selection settings changed since hpo_plan; rerun it")
    t = spec["trials"][chosen]
    payload = {
        "sweep": sweep_index,
        "epsilon": spec["epsilon"],
        "chosen": chosen,
        **_step_dict(_step(t)),
        "release": release,
        "published": published,
        "trial_epsilons": [m["privacy"]["epsilon"] for m in ordered],
        "candidates_r": [x["r"] for x in spec["trials"]],
    }
    _write(out, payload)
    return payload


# --- fit ---------------------------------------------------------------------------------------
def fit(cfg: Config, plan_path: Path, sweep_paths: list[Path], out: Path) -> dict:
    """r(eps) through the sweeps' released best r; r* for the final budget, clamped to the grid.

    With `hpo.monotone`, r* is first floored at the largest released best r: the rule's prior is
    that r does not decrease as eps grows (Prop. 2.1), and extrapolating a noisy negative slope
    from eps2 - eps1 out to e_f would otherwise drive r* to the bottom of the grid.
    """
    p = _read(plan_path)
    _check_plan(cfg, p)
    sw = sorted((_read(x) for x in sweep_paths), key=lambda s: s["sweep"])
    if [s["sweep"] for s in sw] != list(range(len(p["sweeps"]))):
        raise ValueError("fit needs every sweep once")
    f = fit_scaling([(s["epsilon"], s["r"]) for s in sw], p["fit"])
    space = space_of(cfg)
    eps_f = float(p["final"]["epsilon"])
    predicted = f.predict(eps_f)
    floor = max(r for _, r in f.points) if cfg.hpo.monotone else -math.inf
    r_star = space.clamp(max(predicted, floor))
    c = space.decompose_max_steps(r_star)
    payload = {
        "kind": f.kind,
        "coefficients": list(f.coeffs),
        "slope": f.slope,
        "intercept": f.intercept,
        "points": [list(x) for x in f.points],
        "final_epsilon": eps_f,
        "r_predicted": predicted,
        "monotone": cfg.hpo.monotone,
        "r_star": r_star,
        "floored": bool(predicted < floor),
        "clamped": r_star != predicted,
        "final": _step_dict(c),
    }
    _write(out, payload)
    return payload


# --- final run and baselines ---------------------------------------------------------------------
def _final_budget_run(
    cfg: Config,
    p: dict,
    stage: str,
    role: str,
    config: StepConfig,
    target: float,
    seed: int,
    ckpt: Path,
    out_dir: Path,
    extra_wildcards: dict[str, str] | None = None,
    calibrated_steps: int | None = None,
    save: bool = True,
    annotate=None,
) -> dict:
    """Train at a final budget, evaluate on validation and test; return the metrics.

    `annotate(metrics, history)` runs inside the job, before metrics.json is written and
    attached to the MLflow run, to add the stage's own block (e.g. the HPO total).
    """
    from dpadapter.data import build_splits
    from dpadapter.stages.job import training_job
    from dpadapter.train.checkpoint import save_model

    _, roles = build_splits(cfg, [p["task"]])
    d = roles[p["task"]]
    wildcards = {
        "upstream": p["upstream"],
        "task": p["task"],
        "algo": p["algorithm"],
        "seed": str(p["seed"]),
        **(extra_wildcards or {}),
    }
    with training_job(cfg, stage, wildcards, out_dir, parent_run_id=p["parent_run_id"]) as (
        run,
        metrics,
    ):
        run.set_tags({"hpo.role": role})
        res = train_config(
            cfg,
            d.train,
            d.num_classes,
            ckpt,
            p["algorithm"],
            config,
            target,
            seed,
            calibrated_steps=calibrated_steps,
        )
        spent = res.ledger.epsilon()
        if spent > target * (1 + 1e-3):
            raise RuntimeError(f"{stage} spent epsilon {spent:.4f} > its target {target}")
        hyper = {
            **res.algorithm.describe(),
            **_step_dict(config),
            "seed": seed,
            "calibrated_steps": res.spec.total_steps,
            "momentum": cfg.finetune.momentum,
            "strategy": strategy_of(cfg).name,
            "expected_batch_size": res.spec.expected_batch_size,
            "max_grad_norm": res.spec.max_grad_norm,
            "n_train": len(d.train),
        }
        run.log_params(hyper)
        # Test accuracy is computed here, after every choice has been made, and steers nothing.
        test_acc = count_correct(res.model, d.test) / len(d.test)
        val_correct = count_correct(res.model, d.val)
        metrics.update(
            {
                "test_accuracy": test_acc,
                "val_correct": val_correct,
                "val_size": len(d.val),
                "hyperparameters": hyper,
                "privacy": {
                    "mechanism": "gaussian",
                    "accountant": res.spec.accountant,
                    "target_epsilon": target,
                    "epsilon": spent,
                    "delta": res.spec.delta,
                    "steps": res.ledger.steps,
                    "sample_rate": res.spec.sample_rate,
                    "sampling": "poisson",
                    "history": res.ledger.state_dict()["history"],
                },
            }
        )
        run.log_metrics(
            {"test_accuracy": test_acc, "epsilon": spent, "steps": res.ledger.steps, "r": config.r}
        )
        if annotate is not None:
            annotate(metrics, tuple(res.ledger.history))
        if save:
            metrics["checkpoint"] = save_model(
                out_dir / "model.pt",
                res.model,
                cfg.model,
                d.num_classes,
                res.checkpoint_meta["in_chans"],
                {"task": p["task"], "hpo": role},
            )
    return metrics


def final(
    cfg: Config,
    plan_path: Path,
    fit_path: Path,
    sweep_paths: list[Path],
    trial_paths: list[Path],
    ckpt: Path,
    out_dir: Path,
) -> dict:
    """Algorithm 2's last step: train at e_f with r*, then account the whole HPO."""
    p = _read(plan_path)
    _check_plan(cfg, p)
    f = _read(fit_path)
    sweeps = sorted((_read(x) for x in sweep_paths), key=lambda s: s["sweep"])
    trials = [_read(x) for x in trial_paths]
    planned = {
        (k, i): _hist(t["planned_history"])
        for k, s in enumerate(p["sweeps"])
        for i, t in enumerate(s["trials"])
    }
    recorded = {
        (m["hpo"]["sweep"], m["hpo"]["trial"]): _hist(m["privacy"]["history"]) for m in trials
    }
    if set(recorded) != set(planned) or len(trials) != len(planned):
        raise ValueError("final needs the metrics of every trial of the plan, once")
    if len(sweeps) != len(p["sweeps"]):
        raise ValueError("final needs every sweep")
    for key, hist in recorded.items():
        if not is_prefix(hist, planned[key]):
            raise RuntimeError(f"trial {key} released more than planned; its accounting is void")
    releases = tuple(s["release"] for s in sweeps)
    final_planned = _hist(p["final"]["planned_history"])
    delta, target = float(p["delta"]), float(p["target_epsilon"])
    # The bound the final run is allowed under, recomputed from what the trials actually recorded.
    bound = Composition((*recorded.values(), final_planned), releases).epsilon(delta)
    if bound > target + TOL:
        raise RuntimeError(f"trials + selections + final would spend {bound:.4f} > {target}")
    eps_f = float(p["final"]["epsilon"])
    config = _step(f["final"])
    mech = p["selection"]

    def annotate(metrics: dict, final_hist: tuple[Segment, ...]) -> None:
        if not is_prefix(final_hist, final_planned):
            raise RuntimeError("the final run released more than planned")
        total = Composition((*recorded.values(), final_planned), releases).epsilon(delta)
        total_recorded = Composition((*recorded.values(), final_hist), releases).epsilon(delta)
        if max(total, total_recorded) > target + TOL:
            raise RuntimeError(f"the HPO spent {total:.4f} > target {target}")
        metrics["hpo"] = {
            "role": "final",
            "method": "linear_scaling",
            "parent_run_id": p["parent_run_id"],
            "target_epsilon": target,
            "total_epsilon": total,
            "total_epsilon_recorded": total_recorded,
            "total_accountant": "dp-accounting PLD (pessimistic); trials as recorded, selections, "
            "final run as calibrated (calibrated_steps; a shorter run is a prefix of it)",
            "final_epsilon": eps_f,
            "trials": len(recorded),
            "sweep_epsilons": [s["epsilon"] for s in sweeps],
            "sweep_best_r": [s["r"] for s in sweeps],
            "fit": {
                k: f[k]
                for k in (
                    "kind",
                    "coefficients",
                    "slope",
                    "intercept",
                    "r_predicted",
                    "r_star",
                    "clamped",
                )
            },
            **_step_dict(config),
            "selection": mech["mechanism"],
            "selection_accounted": mech["accounted"],
            **({"privacy_assumption": mech["assumption"]} if not mech["accounted"] else {}),
        }
        metrics["privacy"]["validation_use"] = (
            "the final model's val_correct is reported only; the trials' validation counts were "
            "released through the selection mechanism"
            + ("" if mech["accounted"] else " (not accounted)")
        )

    metrics = _final_budget_run(
        cfg,
        p,
        "hpo_final",
        "final",
        config,
        eps_f,
        int(p["final"]["seed"]),
        ckpt,
        out_dir,
        calibrated_steps=int(p["final"]["calibrated_steps"]),
        annotate=annotate,
    )
    h = metrics["hpo"]
    _log_to_parent(
        cfg,
        p["parent_run_id"],
        {
            "linear_scaling_test_accuracy": metrics["test_accuracy"],
            "total_epsilon": h["total_epsilon"],
            "total_epsilon_recorded": h["total_epsilon_recorded"],
            "final_epsilon": eps_f,
            "r_star": f["r_star"],
            "slope": f["slope"],
            "intercept": f["intercept"],
            **{f"sweep{k}_best_r": s["r"] for k, s in enumerate(sweeps)},
        },
    )
    return metrics


def random_search(cfg: Config, plan_path: Path, ckpt: Path, out_dir: Path) -> dict:
    """One run with the whole budget at a random r from the same grid (Sec. 2.1)."""
    p = _read(plan_path)
    _check_plan(cfg, p)
    rs = p["random_search"]

    def annotate(metrics: dict, hist: tuple[Segment, ...]) -> None:
        metrics["hpo"] = {
            "role": "random_search",
            "method": "random_search",
            "parent_run_id": p["parent_run_id"],
            "target_epsilon": p["target_epsilon"],
            "total_epsilon": Composition((hist,)).epsilon(float(p["delta"])),
            **_step_dict(_step(rs)),
            "selection": "none (a single run)",
            "selection_accounted": True,
        }

    metrics = _final_budget_run(
        cfg,
        p,
        "hpo_random_search",
        "random_search",
        _step(rs),
        float(rs["epsilon"]),
        int(rs["seed"]),
        ckpt,
        out_dir,
        annotate=annotate,
    )
    _log_to_parent(
        cfg, p["parent_run_id"], {"random_search_test_accuracy": metrics["test_accuracy"]}
    )
    return metrics


def grid_run(cfg: Config, plan_path: Path, point: int, ckpt: Path, out_dir: Path) -> dict:
    """One point of the r grid at the whole budget (the oracle's candidates)."""
    p = _read(plan_path)
    _check_plan(cfg, p)
    g = p["grid"][point]

    def annotate(metrics: dict, hist: tuple[Segment, ...]) -> None:
        metrics["hpo"] = {
            "role": "grid",
            "point": point,
            "parent_run_id": p["parent_run_id"],
            **_step_dict(_step(g)),
        }

    return _final_budget_run(
        cfg,
        p,
        "hpo_grid_run",
        "grid",
        _step(g),
        float(p["grid_epsilon"]),
        int(p["seed"]),
        ckpt,
        out_dir,
        extra_wildcards={"point": str(point)},
        save=False,
        annotate=annotate,
    )


def choose_by_validation(val_correct: list[int]) -> int:
    """Non-private argmax (the oracle's tuning is not accounted); ties go to the smaller r."""
    return int(np.argmax(val_correct))


def grid_oracle(cfg: Config, plan_path: Path, run_paths: list[Path], out: Path) -> dict:
    """Best grid point by (raw) validation accuracy; everything the grid spent, composed."""
    p = _read(plan_path)
    _check_plan(cfg, p)
    runs = sorted((_read(x) for x in run_paths), key=lambda m: m["hpo"]["point"])
    if [m["hpo"]["point"] for m in runs] != list(range(len(p["grid"]))):
        raise ValueError("grid_oracle needs every grid point once")
    best = choose_by_validation([m["val_correct"] for m in runs])
    total = Composition(tuple(_hist(m["privacy"]["history"]) for m in runs)).epsilon(
        float(p["delta"])
    )
    chosen = runs[best]
    payload = {
        "method": "grid_oracle",
        "upstream": p["upstream"],
        "task": p["task"],
        "algorithm": p["algorithm"],
        "seed": p["seed"],
        "tuning_accounted": False,
        "note": "best of the full r grid at the whole budget, chosen on raw validation accuracy; "
        "the cost of tuning is NOT accounted (total_epsilon composes every grid run to show it)",
        "chosen": best,
        **_step_dict(_step(chosen["hpo"])),
        "test_accuracy": chosen["test_accuracy"],
        "target_epsilon": p["grid_epsilon"],
        "run_epsilon": chosen["privacy"]["epsilon"],
        "total_epsilon": total,
        "grid": [
            {"r": m["hpo"]["r"], "val_accuracy": m["val_correct"] / m["val_size"]} for m in runs
        ],
        "parent_run_id": p["parent_run_id"],
    }
    _write(out, payload)
    _log_to_parent(
        cfg,
        p["parent_run_id"],
        {"grid_oracle_test_accuracy": chosen["test_accuracy"], "grid_total_epsilon": total},
    )
    return payload
