"""federated.csv, the rule's hit rate and the figures, from hand-made metrics."""

import csv
import json

import pytest

from dpadapter.federated import summary


def _write(tmp_path, up, strat, mech, eps, rounds, seed, acc, pred=None):
    d = tmp_path / up / strat / mech / f"eps{eps:g}" / f"T{rounds}" / f"seed{seed}"
    d.mkdir(parents=True)
    m = {
        "wildcards": {
            "upstream": up,
            "strategy": strat,
            "mechanism": mech,
            "eps": f"{eps:g}",
            "rounds": str(rounds),
            "seed": str(seed),
        },
        "test_accuracy": acc,
        "privacy": {"epsilon": eps * 0.99},
        "predicted_best": pred,
    }
    (d / "metrics.json").write_text(json.dumps(m))
    return d / "metrics.json"


@pytest.fixture
def metrics(tmp_path):
    paths = []
    # eps 1: HT wins clearly, rule says ht (hit); eps 4: FT wins, rule split 1-1; eps 8: FT wins,
    # rule says ht (miss)
    table = {
        1.0: (0.60, 0.50, ["ht", "ht"]),
        4.0: (0.60, 0.70, ["ht", "ft"]),
        8.0: (0.6, 0.8, ["ht", "ht"]),
    }
    for eps, (ht, ft, preds) in table.items():
        for seed in (0, 1):
            paths.append(
                _write(tmp_path, "standard", "ht", "gaussian", eps, 20, seed, ht + 0.01 * seed)
            )
            paths.append(
                _write(tmp_path, "standard", "ft", "gaussian", eps, 20, seed, ft - 0.01 * seed)
            )
            paths.append(
                _write(tmp_path, "standard", "ut", "gaussian", eps, 20, seed, ht, preds[seed])
            )
            paths.append(_write(tmp_path, "scratch", "scratch", "gaussian", eps, 20, seed, 0.3))
    for t in (10, 40):
        paths.append(_write(tmp_path, "standard", "ht", "gaussian", 4.0, t, 0, 0.5))
    return paths


def test_rows_csv_and_rule_report(metrics, tmp_path, tiny_cfg):
    rows, preds = summary.collect(metrics)
    report = summary.rule_report(rows, preds)
    assert report["n_cells"] == 3 and report["hits"] == 1 and report["split_cells"] == 1
    assert report["hit_rate"] == pytest.approx(1 / 3)
    assert report["per_job_hit_rate"] == pytest.approx(3 / 6)
    by_eps = {c["epsilon"]: c for c in report["cells"]}
    assert by_eps[1.0]["winner"] == "ht" and by_eps[1.0]["hit"]
    assert by_eps[4.0]["predicted"] == "split" and not by_eps[4.0]["hit"]
    assert by_eps[8.0]["winner"] == "ft" and not by_eps[8.0]["hit"]
    out = tmp_path / "s"
    summary.run(
        tiny_cfg,
        metrics,
        out / "federated.csv",
        out / "rule.json",
        out / "e.png",
        out / "r.png",
        out / "federated.md",
    )
    got = list(csv.DictReader(open(out / "federated.csv")))
    assert list(got[0])[:8] == [
        "strategy",
        "mechanism",
        "epsilon",
        "rounds",
        "mean_accuracy",
        "std_accuracy",
        "n_seeds",
        "predicted_best",
    ]
    scratch = [r for r in got if r["strategy"] == "scratch" and r["epsilon"] == "1"]
    assert scratch[0]["predicted_best"] == "ht" and scratch[0]["n_seeds"] == "2"
    ht1 = [r for r in got if r["strategy"] == "ht" and r["epsilon"] == "1" and r["rounds"] == "20"]
    assert float(ht1[0]["mean_accuracy"]) == pytest.approx(0.605)
    assert json.loads((out / "rule.json").read_text())["hits"] == 1
    md = (out / "federated.md").read_text()
    assert "| standard | HT (head) | 60.5 ± " in md and "(n=2)" in md and "How to read this" in md
    for png in ("e.png", "r.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
