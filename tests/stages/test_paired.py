"""Upstreams compared by seed (issue 48): paired differences, the pooled estimate, its power.

The planted tests simulate what the default grid measures (4 cells x 3 seeds, a cell effect, a
seed effect shared by both upstreams of a seed, and noise) and check that the stated rates are
the rates: a shift of the stated detectable size is found about 80 % of the time, no shift about
5 %, and that pairing is what makes the difference (the same data unpaired detects less).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from dpadapter.ground.stats import detectable_difference, paired_interval, pooled_paired
from dpadapter.stages import aggregate, paired

CELLS = [("same", 1.0), ("same", 4.0), ("shift", 1.0), ("shift", 4.0)]
SEEDS = 3
NOISE = 0.01  # the residual spread of a difference: 1 point


def _grid(rng, shift: float, seed_sd: float = 0.03) -> dict[tuple, dict[int, float]]:
    acc: dict[tuple, dict[int, float]] = {}
    luck = rng.normal(0, seed_sd, size=(len(CELLS), SEEDS))  # shared by both upstreams
    for i, (task, eps) in enumerate(CELLS):
        base = 0.7 + 0.05 * i
        for up, extra in (("standard", 0.0), ("dpadapter", shift)):
            noise = rng.normal(0, NOISE / np.sqrt(2), size=SEEDS)
            acc[(up, task, "dpsgd", eps)] = {
                s: base + luck[i, s] + extra + noise[s] for s in range(SEEDS)
            }
    return acc


def _detected(acc) -> bool:
    c = paired.compare(acc, "dpadapter", "standard", "dpsgd")
    p = c["pooled"]
    return p["low"] > 0 or p["high"] < 0


def _true_detectable() -> float:
    n = len(CELLS) * SEEDS
    df = n - len(CELLS) - SEEDS + 1
    return detectable_difference(NOISE / np.sqrt(n), df)


@pytest.mark.slow  # in-process, too long for `make check`
@pytest.mark.parametrize("shift,lo,hi", [(None, 0.70, 0.90), (0.0, 0.0, 0.10)])
def test_a_planted_shift_is_detected_at_the_stated_rates(shift, lo, hi):
    rng = np.random.default_rng(12345)
    size = _true_detectable() if shift is None else shift
    runs = 300
    hits = sum(_detected(_grid(rng, size)) for _ in range(runs))
    assert lo <= hits / runs <= hi, (size, hits)


def test_pairing_detects_what_the_unpaired_cell_means_miss():
    """Seeds that are lucky or unlucky for both upstreams: paired, the shift stands out."""
    rng = np.random.default_rng(7)
    paired_hits = unpaired_hits = 0
    for _ in range(100):
        acc = _grid(rng, 0.02, seed_sd=0.03)
        paired_hits += _detected(acc)
        # unpaired: each cell's means, the differences of means over cells (the old reading)
        diffs = [
            np.mean(list(acc[("dpadapter", t, "dpsgd", e)].values()))
            - np.mean(list(acc[("standard", t, "dpsgd", e)].values()))
            for t, e in CELLS
        ]
        se = np.sqrt(
            np.mean(
                [
                    np.var(list(acc[(u, t, "dpsgd", e)].values()), ddof=1) / SEEDS
                    for u in ("dpadapter", "standard")
                    for t, e in CELLS
                ]
            )
            * 2
            / len(CELLS)
        )
        unpaired_hits += abs(np.mean(diffs)) > 1.96 * se
    assert paired_hits >= 90 and unpaired_hits <= 50, (paired_hits, unpaired_hits)


def test_the_section_under_the_table_and_its_numbers(tmp_path):
    paths = []
    for task, eps in CELLS:
        for up, acc in (("standard", 0.80), ("dpadapter", 0.83), ("control", 0.80)):
            for seed, luck in enumerate((0.01, -0.02, 0.005)):
                m = {
                    "wildcards": {"upstream": up, "task": task, "algo": "dpsgd",
                                  "eps": f"{eps:g}", "seed": str(seed)},
                    "test_accuracy": acc + luck + 0.002 * ((seed + len(up) + len(task)) % 3),
                    "test_robust_accuracy": acc, "privacy": {"epsilon": eps},
                    "wall_time_s": 6.0,
                }  # fmt: skip
                p = tmp_path / f"{up}-{task}-{eps}-{seed}.json"
                p.write_text(json.dumps(m))
                paths.append(p)
    aggregate.run(paths, [], ["standard", "dpadapter", "control"], tmp_path / "f.csv",
                  tmp_path / "f.md", tmp_path / "paired.json")  # fmt: skip
    md = (tmp_path / "f.md").read_text()
    assert "### Paired differences" in md and "| dpadapter − standard | dpsgd |" in md
    assert "**Power.** With 3 seeds" in md and "5 seeds" in md and "job-minutes" in md
    result = json.loads((tmp_path / "paired.json").read_text())
    first = result["comparisons"][0]
    assert (first["upstream"], first["versus"]) == ("dpadapter", "standard")
    p = first["pooled"]
    assert p["estimate"] == pytest.approx(0.03, abs=0.002) and p["low"] > 0
    assert p["cells"] == 4 and p["seeds"] == 3 and p["df"] == 12 - 4 - 3 + 1
    assert len(first["cells"]) == 4 and all(len(c["diffs"]) == 3 for c in first["cells"])
    # the seed luck is shared: the per-seed differences carry none of it
    for c in first["cells"]:
        assert max(c["diffs"].values()) - min(c["diffs"].values()) < 0.01


def test_one_seed_gives_no_interval_and_says_so():
    acc = {
        ("dpadapter", "t", "dpsgd", 1.0): {0: 0.8},
        ("standard", "t", "dpsgd", 1.0): {0: 0.7},
    }
    c = paired.compare(acc, "dpadapter", "standard", "dpsgd")
    assert c["pooled"] is None and "detectable" not in c
    result = {"power": 0.8, "alpha": 0.05, "seeds": [0], "jobs": 2, "comparisons": [c]}
    assert "With one seed per cell no difference can be tested" in paired.markdown(result)


def test_the_library_numbers():
    ci = paired_interval([0.01, 0.02, 0.03])
    assert ci.estimate == pytest.approx(0.02) and ci.low < 0.02 < ci.high and ci.n == 3
    rows = [(c, s, 0.01 * c + 0.001 * s) for c in range(3) for s in range(3)]  # additive, exact
    p = pooled_paired(rows)
    assert p["estimate"] == pytest.approx(0.011) and p["residual_sd"] < 1e-12
    # larger se, larger detectable difference; ~2.8 se at many degrees of freedom (z: 1.96+0.84)
    assert detectable_difference(1.0, 1000) == pytest.approx(2.80, abs=0.02)
    assert detectable_difference(1.0, 2) > detectable_difference(1.0, 6) > 2.8
    assert detectable_difference(0.0, 6) is None and detectable_difference(1.0, 0) is None
