"""The network regime's trials and the private release of each sweep's winner (Algorithm 3).

`trial` trains one configuration of a sweep for T steps at the sweep's epsilon and scores it by
its count of correct predictions on the validation split (carved from private training data);
`sweep` releases the sweep's best trial through the selection mechanism.
"""

from __future__ import annotations

from pathlib import Path

from dpadapter.hpo.accounting import history_of, is_prefix
from dpadapter.hpo.network.plan import load_plan, read_json, write_json
from dpadapter.hpo.network.runner import count_correct, private_data, strategy_of, train_config
from dpadapter.hpo.seeds import SELECTION_STREAM
from dpadapter.hpo.selection import selection_of
from dpadapter.hpo.space import step_dict, step_from
from dpadapter.privacy.randomness import selection_random
from dpadapter.settings import Config


def trial(cfg: Config, plan_path: Path, sweep: int, index: int, ckpt: Path, out_dir: Path) -> dict:
    """One trial; only the training and validation splits are loaded."""
    from dpadapter.train.dp_fit import privacy_record
    from dpadapter.train.job import training_job

    p = load_plan(cfg, plan_path)
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
            cfg, data.train, data.num_classes, ckpt, p["algorithm"], step_from(t), eps, t["seed"]
        )
        recorded = tuple(res.ledger.history)
        if (
            not is_prefix(recorded, history_of(t["planned_history"]))
            or res.ledger.steps != t["steps"]
        ):
            raise RuntimeError("the trial's releases differ from its plan; rerun hpo_plan")
        correct = count_correct(res.model, data.val)
        spent = res.ledger.epsilon()
        if spent > eps * (1 + 1e-3):
            raise RuntimeError(f"trial spent epsilon {spent:.4f} > its target {eps}")
        hyper = {
            **res.algorithm.describe(),
            **step_dict(step_from(t)),
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
                    **step_dict(step_from(t)),
                },
                # Raw statistic of private data, kept curator-side (this file) for the selection
                # job; not logged as an MLflow metric, never in hpo.csv/md. Only the selection
                # mechanism's output (hpo_sweep) leaves the curator.
                "val_correct": correct,
                "val_size": len(data.val),
                "hyperparameters": hyper,
                "privacy": {
                    **privacy_record(res.spec, res.ledger, eps, spent),
                    "validation_use": "val_correct is the score of the sweep's private selection "
                    "(hpo_sweep), whose cost is composed into the HPO total",
                },
            }
        )
    return metrics


def sweep(
    cfg: Config, plan_path: Path, sweep_index: int, trial_paths: list[Path], out: Path
) -> dict:
    """Release the sweep's best trial through the selection mechanism (Algorithm 3)."""
    p = load_plan(cfg, plan_path)
    spec = p["sweeps"][sweep_index]
    ms = [read_json(x) for x in trial_paths]
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
    rng = selection_random(cfg.privacy.randomness, [p["seed"], SELECTION_STREAM, sweep_index])
    chosen, published = mech.select([m["val_correct"] for m in ordered], rng)
    release = mech.release(len(ordered))
    if release != spec["selection_release"]:
        raise ValueError("selection settings changed since hpo_plan; rerun it")
    t = spec["trials"][chosen]
    payload = {
        "sweep": sweep_index,
        "epsilon": spec["epsilon"],
        "chosen": chosen,
        **step_dict(step_from(t)),
        "release": release,
        "published": published,
        "trial_epsilons": [m["privacy"]["epsilon"] for m in ordered],
        "candidates_r": [x["r"] for x in spec["trials"]],
    }
    write_json(out, payload)
    return payload
