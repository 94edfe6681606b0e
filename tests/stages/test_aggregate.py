"""finetune.csv / finetune.md: statistics over seeds and the Table 1 layout."""

from __future__ import annotations

import csv
import json
import statistics
from pathlib import Path

import pytest

from dpadapter.stages import aggregate


def _metrics(root: Path, up: str, task: str, algo: str, eps: float, seed: int, acc: float):
    d = root / up / task / algo / f"eps{eps:g}" / f"seed{seed}"
    d.mkdir(parents=True)
    m = {
        "wildcards": {"upstream": up, "task": task, "algo": algo, "eps": f"{eps:g}", "seed": seed},
        "test_accuracy": acc,
        "test_robust_accuracy": acc - 0.1,
        "privacy": {"epsilon": 0.9 * eps},
    }
    (d / "metrics.json").write_text(json.dumps(m))
    return d / "metrics.json"


@pytest.fixture
def grid(tmp_path):
    paths = []
    accs = {0: 0.70, 1: 0.74, 2: 0.78}
    for up in ("scratch", "standard"):
        for task in ("a", "b"):
            for eps in (1, 4):
                for seed, acc in accs.items():
                    bump = 0.1 if up == "standard" else 0.0
                    paths.append(_metrics(tmp_path, up, task, "dpsgd", eps, seed, acc + bump))
    # a second algorithm on one upstream method and task only (an extra grid), one seed
    paths.append(_metrics(tmp_path, "standard", "b", "gep", 1, 0, 0.5))
    return paths


def test_mean_std_and_csv_columns(grid, tmp_path):
    rows = aggregate.collect(grid)
    out = tmp_path / "finetune.csv"
    aggregate.write_csv(rows, out, aggregate.COLUMNS)
    got = list(csv.DictReader(open(out)))
    assert list(got[0]) == aggregate.COLUMNS
    row = next(
        r for r in got if (r["upstream"], r["task"], r["algorithm"], r["epsilon"])
        == ("standard", "a", "dpsgd", "4")
    )  # fmt: skip
    assert float(row["mean_accuracy"]) == pytest.approx(0.84, abs=1e-4)
    assert float(row["std_accuracy"]) == pytest.approx(statistics.stdev([0.8, 0.84, 0.88]), 1e-3)
    assert row["n_seeds"] == "3"
    assert float(row["mean_epsilon_spent"]) == pytest.approx(3.6, abs=1e-4)
    gep = [r for r in got if r["algorithm"] == "gep"]
    assert len(gep) == 1 and gep[0]["n_seeds"] == "1" and float(gep[0]["std_accuracy"]) == 0


def test_markdown_has_one_block_per_algorithm_and_no_empty_rows(grid):
    md = aggregate.table1_markdown(aggregate.collect(grid), ["scratch", "standard"])
    table = [
        ln for ln in md.split("\n\n")[1].splitlines() if ln.startswith("| ") and "---" not in ln
    ]
    header, body = table[0], table[1:]
    assert "a ε=1" in header and "Average ε=4" in header
    assert [tuple(c.strip() for c in ln.split("|")[1:3]) for ln in body] == [
        ("dpsgd", "scratch"),
        ("dpsgd", "standard"),
        ("gep", "standard"),  # not gep x scratch: never run, so no row of dashes
    ]
    dpsgd_standard = [c.strip() for c in body[1].split("|")[1:-1]]
    assert dpsgd_standard[2] == "84.0 ± 4.0 (n=3)"  # a eps=1: mean ± std over the 3 seeds
    # eps=4 equals eps=1 here: no drop, so no flag
    assert dpsgd_standard[3] == "84.0 ± 4.0 (n=3)"
    assert dpsgd_standard[-1] == "84.0"  # average over both tasks at eps=4
    gep = [c.strip() for c in body[2].split("|")[1:-1]]
    # one seed: no ±, marked n = 1 ; one task of two: no average
    assert gep[4] == "50.0 (n=1)†" and gep[-2] == "–"
    assert "How to read this" in md


def _with_strategy(path: Path, strategy: str, t1: int = 0, steps: int = 16) -> Path:
    """A job's metrics as a job of `strategy` writes them (finetune.strategies)."""
    m = json.loads(path.read_text())
    m["hyperparameters"] = {"strategy": strategy, "t1": t1}
    m["privacy"]["steps"] = steps
    if strategy != "ft":
        m["wildcards"]["strategy"] = strategy
    path.write_text(json.dumps(m))
    return path


def test_strategies_are_a_column_and_one_strategy_is_named_in_the_title(tmp_path):
    paths = []
    for strategy, acc, t1 in (("ht", 0.6, 0), ("ft", 0.7, 0), ("ut", 0.8, 8)):
        for seed in (0, 1):
            p = _metrics(tmp_path / strategy, "standard", "a", "dpsgd", 1, seed, acc + 0.01 * seed)
            paths.append(_with_strategy(p, strategy, t1))
    rows = aggregate.collect(paths)
    out = tmp_path / "finetune.csv"
    aggregate.write_csv(rows, out, aggregate.COLUMNS)
    got = {r["strategy"]: r for r in csv.DictReader(open(out))}
    assert sorted(got) == ["ft", "ht", "ut"]
    assert {r["algorithm"] for r in got.values()} == {"dpsgd"}
    assert float(got["ut"]["mean_accuracy"]) == pytest.approx(0.805)
    md = aggregate.table1_markdown(rows, ["standard"])
    table = [ln for ln in md.splitlines() if ln.startswith("| ")]
    assert table[0].startswith("| Algorithm | Strategy | Upstream | a ε=1")
    labels = [tuple(c.strip() for c in ln.split("|")[1:4]) for ln in table[1:4]]
    assert labels == [("dpsgd", "ft", "standard"), ("dpsgd", "ht", "standard"),
                      ("dpsgd", "ut, T₁ 50%", "standard")]  # fmt: skip
    # the ε-spent table has the same rows, one per strategy
    spent = md[md.index("ε spent") :].splitlines()
    assert sum(ln.startswith("| dpsgd | ") for ln in spent) == 3
    one = aggregate.table1_markdown(aggregate.collect(paths[2:4]), ["standard"])
    assert one.startswith(
        "Test accuracy (%) of DP fine-tuning, tuning strategy ft (full tuning: every weight)"
    )
    assert "| Algorithm | Upstream |" in one and "Strategy" not in one
