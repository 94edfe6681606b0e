"""validity.md from hand-written summaries: numbers, intervals, verdicts and missing runs."""

import json

import pytest

from dpadapter.stages import validity


def _hpo(tmp_path, rerr_ci, holds=True):
    lo, est, hi = rerr_ci
    cell = {
        "upstream": "standard",
        "task": "fmnist-shift-hpo",
        "seeds": [0, 1, 2, 3, 4],
        "premise": {
            "epsilons": [0.1, 1.0],
            "best_r": [10.0, 100.0],
            "slope": 100.0,
            "r2": 0.95,
            "spearman": 1.0,
            "holds": holds,
        },  # fmt: skip
        "targets": {
            "1": {
                "margin": 0.17,
                "accounted": {
                    "rerr_interval": {"estimate": est, "low": lo, "high": hi, "n": 5},
                    "max_total_epsilon": 0.9999,
                },
            }
        },
    }
    p = tmp_path / "hpo.json"
    p.write_text(json.dumps({"cells": [cell]}))
    return p


def _rule(tmp_path, hits, n, low, high, always_ht=0.6):
    p = tmp_path / "rule.json"
    p.write_text(
        json.dumps(
            {
                "n_cells": n,
                "hits": hits,
                "cells": [{"n_seeds_rule": 5}] * n,
                "hit_rate_interval": {"estimate": hits / n, "low": low, "high": high},
                "always_ht": always_ht,
                "always_ft": 1 - always_ht,
                "coin": 0.5,
                "step_size_jobs_holding": 40,
                "step_size_jobs": 50,
                "n_cells_step_size_holds": 6,
            }  # fmt: skip
        )
    )
    return p


def _paired(tmp_path, dpadapter_acc):
    """paired.json (`stages.paired`) of a grid of jobs: three seeds, per-seed spread."""
    from dpadapter.stages import paired

    paths = []
    for task in ("same", "shift"):
        for eps in (1, 4):
            for up, acc in (("standard", 0.80), ("control", 0.79), ("dpadapter", dpadapter_acc)):
                for seed, luck in enumerate((0.004, -0.006, 0.002)):
                    wiggle = 0.001 * ((seed * 7 + len(up)) % 3)
                    m = {"wildcards": {"upstream": up, "task": task, "algo": "dpsgd",
                                       "eps": str(eps), "seed": str(seed)},
                         "test_accuracy": acc + 0.001 * eps + luck + wiggle}  # fmt: skip
                    p = tmp_path / f"{up}-{task}-{eps}-{seed}.json"
                    p.write_text(json.dumps(m))
                    paths.append(p)
    out = tmp_path / "paired.json"
    paired.run([json.loads(p.read_text()) for p in paths], out)
    return out


def test_every_claim_has_paper_ours_setting_and_verdict(tmp_path):
    text = validity.build(
        _hpo(tmp_path, (0.6, 0.8, 0.9)),
        _rule(tmp_path, 9, 10, 0.6, 0.98),
        None,
        None,
        _paired(tmp_path, 0.78),
    )
    assert "77.6 %" in text and "RERR 80.0 % [60.0, 90.0]" in text
    assert "better than random search: **holds**" in text and "consistent with the paper" in text
    assert "Premise" in text and "**holds**" in text
    assert "9/10 cells" in text and "[0.60, 0.98] (95 % Wilson)" in text
    assert "40/50 rule jobs" in text
    assert "Better than the best fixed choice (0.60)**: **inconclusive**" in text
    assert "72.92 %" in text and "DPAdapter − standard" in text and "DPAdapter − control" in text
    assert "DPAdapter better: **does not hold**" in text  # 0.78 < 0.80 in every cell
    assert "paired by seed" in text and "would be detected with 80% power" in text
    assert "GPU run pending" in text


def test_negative_results_are_said_plainly(tmp_path):
    text = validity.build(
        _hpo(tmp_path, (-0.5, -0.3, -0.1), holds=False),
        _rule(tmp_path, 3, 10, 0.1, 0.6, always_ht=0.7),
        None,
        None,
        _paired(tmp_path, 0.85),
    )
    assert "better than random search: **does not hold**" in text
    assert "below the paper's range" in text
    assert "→ **does not hold**. Oracle" in text  # the premise
    assert "Better than the best fixed choice (0.70)**: **does not hold**" in text
    assert "DPAdapter − standard" in text and "**holds**" in text.split("## 3.")[1]


def test_missing_runs_name_their_command(tmp_path):
    text = validity.build(None, tmp_path / "nope.json", None)
    assert "not run — `make hpo`" in text
    assert "not run — `make federated`" in text
    assert "not run — `make run`" in text


@pytest.mark.parametrize(
    "low,high,want",
    [(0.1, 0.3, "holds"), (-0.3, -0.1, "does not hold"), (-0.1, 0.2, "inconclusive")],
)
def test_verdict(low, high, want):
    assert validity._verdict(low, high, 0.0) == want
