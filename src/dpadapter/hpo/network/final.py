"""The network regime's last two stages (Algorithm 2): the fit r(eps) through the sweeps'
released best r, and the final run at e_f with r*, after which the whole HPO is accounted again
from what the trials actually recorded.
"""

from __future__ import annotations

import math
from pathlib import Path

from dpadapter.hpo.accounting import TOL, Composition, history_of, is_prefix
from dpadapter.hpo.network.full_budget import final_budget_run
from dpadapter.hpo.network.plan import load_plan, log_to_parent, read_json, write_json
from dpadapter.hpo.space import fit_scaling, space_of, step_dict, step_from
from dpadapter.privacy import Segment
from dpadapter.settings import Config


def fit(cfg: Config, plan_path: Path, sweep_paths: list[Path], out: Path) -> dict:
    """r(eps) through the sweeps' released best r; r* for the final budget, clamped to the grid.

    With `hpo.monotone`, r* is first floored at the largest released best r: the rule's prior is
    that r does not decrease as eps grows (Prop. 2.1), and extrapolating a noisy negative slope
    from eps2 - eps1 out to e_f would otherwise drive r* to the bottom of the grid.
    """
    p = load_plan(cfg, plan_path)
    sw = sorted((read_json(x) for x in sweep_paths), key=lambda s: s["sweep"])
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
        "final": step_dict(c),
    }
    write_json(out, payload)
    return payload


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
    p = load_plan(cfg, plan_path)
    f = read_json(fit_path)
    sweeps = sorted((read_json(x) for x in sweep_paths), key=lambda s: s["sweep"])
    trials = [read_json(x) for x in trial_paths]
    planned = {
        (k, i): history_of(t["planned_history"])
        for k, s in enumerate(p["sweeps"])
        for i, t in enumerate(s["trials"])
    }
    recorded = {
        (m["hpo"]["sweep"], m["hpo"]["trial"]): history_of(m["privacy"]["history"]) for m in trials
    }
    if set(recorded) != set(planned) or len(trials) != len(planned):
        raise ValueError("final needs the metrics of every trial of the plan, once")
    if len(sweeps) != len(p["sweeps"]):
        raise ValueError("final needs every sweep")
    for key, hist in recorded.items():
        if not is_prefix(hist, planned[key]):
            raise RuntimeError(f"trial {key} released more than planned; its accounting is void")
    releases = tuple(s["release"] for s in sweeps)
    final_planned = history_of(p["final"]["planned_history"])
    delta, target = float(p["delta"]), float(p["target_epsilon"])
    # The bound the final run is allowed under, recomputed from what the trials actually recorded.
    bound = Composition((*recorded.values(), final_planned), releases).epsilon(delta)
    if bound > target + TOL:
        raise RuntimeError(f"trials + selections + final would spend {bound:.4f} > {target}")
    eps_f = float(p["final"]["epsilon"])
    config = step_from(f["final"])
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
            **step_dict(config),
            "selection": mech["mechanism"],
            "selection_accounted": mech["accounted"],
            **({"privacy_assumption": mech["assumption"]} if not mech["accounted"] else {}),
        }
        metrics["privacy"]["validation_use"] = (
            "the final model's val_correct is reported only; the trials' validation counts were "
            "released through the selection mechanism"
            + ("" if mech["accounted"] else " (not accounted)")
        )

    metrics = final_budget_run(
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
    log_to_parent(
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
