"""The network regime's baselines (Sec. 5.2.3): random search (one run at a random r with the
whole budget) and the grid oracle (every grid point at the whole budget, the best by raw
validation accuracy; its tuning is NOT accounted, and `total_epsilon` shows what it spent).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dpadapter.hpo.accounting import Composition, history_of
from dpadapter.hpo.network.full_budget import final_budget_run
from dpadapter.hpo.network.plan import load_plan, log_to_parent, read_json, write_json
from dpadapter.hpo.space import step_dict, step_from
from dpadapter.privacy import Segment
from dpadapter.settings import Config


def random_search(cfg: Config, plan_path: Path, ckpt: Path, out_dir: Path) -> dict:
    """One run with the whole budget at a random r from the same grid (Sec. 2.1)."""
    p = load_plan(cfg, plan_path)
    rs = p["random_search"]

    def annotate(metrics: dict, hist: tuple[Segment, ...]) -> None:
        metrics["hpo"] = {
            "role": "random_search",
            "method": "random_search",
            "parent_run_id": p["parent_run_id"],
            "target_epsilon": p["target_epsilon"],
            "total_epsilon": Composition((hist,)).epsilon(float(p["delta"])),
            **step_dict(step_from(rs)),
            "selection": "none (a single run)",
            "selection_accounted": True,
        }

    metrics = final_budget_run(
        cfg,
        p,
        "hpo_random_search",
        "random_search",
        step_from(rs),
        float(rs["epsilon"]),
        int(rs["seed"]),
        ckpt,
        out_dir,
        annotate=annotate,
    )
    log_to_parent(
        cfg, p["parent_run_id"], {"random_search_test_accuracy": metrics["test_accuracy"]}
    )
    return metrics


def grid_run(cfg: Config, plan_path: Path, point: int, ckpt: Path, out_dir: Path) -> dict:
    """One point of the r grid at the whole budget (the oracle's candidates)."""
    p = load_plan(cfg, plan_path)
    g = p["grid"][point]

    def annotate(metrics: dict, hist: tuple[Segment, ...]) -> None:
        metrics["hpo"] = {
            "role": "grid",
            "point": point,
            "parent_run_id": p["parent_run_id"],
            **step_dict(step_from(g)),
        }

    return final_budget_run(
        cfg,
        p,
        "hpo_grid_run",
        "grid",
        step_from(g),
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
    p = load_plan(cfg, plan_path)
    runs = sorted((read_json(x) for x in run_paths), key=lambda m: m["hpo"]["point"])
    if [m["hpo"]["point"] for m in runs] != list(range(len(p["grid"]))):
        raise ValueError("grid_oracle needs every grid point once")
    best = choose_by_validation([m["val_correct"] for m in runs])
    total = Composition(tuple(history_of(m["privacy"]["history"]) for m in runs)).epsilon(
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
        **step_dict(step_from(chosen["hpo"])),
        "test_accuracy": chosen["test_accuracy"],
        "target_epsilon": p["grid_epsilon"],
        "run_epsilon": chosen["privacy"]["epsilon"],
        "total_epsilon": total,
        "grid": [
            {"r": m["hpo"]["r"], "val_accuracy": m["val_correct"] / m["val_size"]} for m in runs
        ],
        "parent_run_id": p["parent_run_id"],
    }
    write_json(out, payload)
    log_to_parent(
        cfg,
        p["parent_run_id"],
        {"grid_oracle_test_accuracy": chosen["test_accuracy"], "grid_total_epsilon": total},
    )
    return payload
