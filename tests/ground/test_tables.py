"""The shared cell rules (dpadapter.ground.tables): ± and n, the n = 1 mark, and the ε-order
flags."""

import pytest

from dpadapter.ground import tables
from dpadapter.ground.tables import INVERTED, SINGLE, UNKNOWN, WITHIN_NOISE, Stat
from dpadapter.stages import aggregate


def test_stat_of_seeds():
    s = Stat.of([0.70, 0.74, 0.78])
    assert (s.mean, s.n) == (pytest.approx(0.74), 3) and s.std == pytest.approx(0.04)
    assert Stat.of([0.5]) == Stat(0.5, 0.0, 1)


def test_cell_shows_mean_std_and_n_and_marks_one_seed():
    assert tables.cell(Stat(0.84, 0.04, 3)) == "84.0 ± 4.0 (n=3)"
    assert tables.cell(Stat(0.5, 0.0, 1)) == f"50.0 (n=1){SINGLE}"
    assert tables.cell(Stat(0.5, 0.0, 1), UNKNOWN) == f"50.0 (n=1){SINGLE} {UNKNOWN}"
    assert tables.cell(None) == "–"


def test_inverted_beyond_noise_is_flagged():
    # 10 points lower at the larger epsilon, combined std sqrt(3² + 4²) = 5 points
    lo, hi = Stat(0.80, 0.03, 3), Stat(0.70, 0.04, 3)
    assert tables.combined_std(lo, hi) == pytest.approx(0.05)
    assert tables.order_flag(lo, hi) == INVERTED


def test_inverted_within_noise_says_so():
    # 4 points lower, combined std 5 points: indistinguishable
    assert tables.order_flag(Stat(0.80, 0.03, 3), Stat(0.76, 0.04, 3)) == WITHIN_NOISE
    # just inside and just outside the boundary
    assert tables.order_flag(Stat(0.80, 0.03, 3), Stat(0.751, 0.04, 3)) == WITHIN_NOISE
    assert tables.order_flag(Stat(0.80, 0.03, 3), Stat(0.749, 0.04, 3)) == INVERTED


def test_no_flag_when_the_larger_epsilon_does_as_well():
    assert tables.order_flag(Stat(0.70, 0.0, 3), Stat(0.70, 0.0, 3)) is None
    assert tables.order_flag(Stat(0.70, 0.05, 3), Stat(0.90, 0.05, 3)) is None


def test_one_seed_drop_is_unknown_not_judged():
    # with one seed on either side the std is not measured (0 by convention): a drop of any
    # size cannot be called beyond noise
    assert tables.order_flag(Stat(0.80, 0.0, 1), Stat(0.60, 0.0, 1)) == UNKNOWN
    assert tables.order_flag(Stat(0.80, 0.01, 3), Stat(0.60, 0.0, 1)) == UNKNOWN


def test_each_cell_is_compared_with_every_smaller_epsilon():
    row = {
        1.0: Stat(0.80, 0.002, 3),
        2.0: Stat(0.78, 0.05, 3),  # within noise of eps 1
        4.0: Stat(0.79, 0.001, 3),  # above eps 2 but 1 point below eps 1 beyond noise
        8.0: Stat(0.90, 0.01, 3),
    }
    assert tables.epsilon_flags(row) == {1.0: None, 2.0: WITHIN_NOISE, 4.0: INVERTED, 8.0: None}


def _rows(acc_eps1, acc_eps4, std, n):
    return [
        {
            "upstream": "standard",
            "task": "t",
            "algorithm": "dpsgd",
            "epsilon": e,
            "mean_accuracy": a,
            "std_accuracy": std,
            "n_seeds": n,
            "mean_robust_accuracy": a,
            "std_robust_accuracy": std,
            "mean_epsilon_spent": e,
        }
        for e, a in ((1.0, acc_eps1), (4.0, acc_eps4))
    ]


@pytest.mark.parametrize(
    ("eps1", "eps4", "std", "n", "want"),
    [
        (0.80, 0.70, 0.02, 3, f"70.0 ± 2.0 (n=3) {INVERTED}"),
        (0.80, 0.78, 0.02, 3, f"78.0 ± 2.0 (n=3) {WITHIN_NOISE}"),
        (0.80, 0.70, 0.0, 1, f"70.0 (n=1){SINGLE} {UNKNOWN}"),
        (0.70, 0.80, 0.02, 3, "80.0 ± 2.0 (n=3)"),
    ],
)
def test_finetune_table_carries_the_flags(eps1, eps4, std, n, want):
    md = aggregate.table1_markdown(_rows(eps1, eps4, std, n), ["standard"])
    body = [ln for ln in md.splitlines() if ln.startswith("| dpsgd | standard |")]
    # the accuracy table and the robust-accuracy table, eps=4 is the fourth cell of each (the
    # third table, ε spent, has no marks of this kind)
    assert [[c.strip() for c in ln.split("|")[1:-1]][3] for ln in body[:2]] == [want, want]
    assert "How to read this" in md


def test_cells_that_know_their_seeds_are_compared_seed_with_seed():
    """Issue 48: seed 1 low at both ε. Unpaired, its luck is noise and the 2-point drop is
    within it; paired, every seed drops by about 2 points: beyond the noise of the differences."""
    lo = Stat.of([0.80, 0.70, 0.81], seeds=[0, 1, 2])
    hi = Stat.of([0.78, 0.68, 0.785], seeds=[0, 1, 2])
    unpaired = (Stat(lo.mean, lo.std, lo.n), Stat(hi.mean, hi.std, hi.n))
    assert tables.order_flag(*unpaired) == WITHIN_NOISE
    assert tables.order_flag(lo, hi) == INVERTED
    # two seeds drop, one gains more
    hi2 = Stat.of([0.78, 0.68, 0.86], seeds=[0, 1, 2])
    assert tables.order_flag(lo, hi2) is None  # on average no drop
    # seeds that do not match: unpaired, as before
    other = Stat.of([0.78, 0.68, 0.785], seeds=[5, 6, 7])
    assert tables.order_flag(lo, other) == WITHIN_NOISE
    assert "per-seed differences" in tables.how_to_read(paired=True)
    assert "combined std" in tables.how_to_read()


def test_the_fine_tuning_table_shows_epsilon_spent_and_marks_an_underspent_cell(tmp_path):
    """Issue 50, item 1: ε spent (with δ and the accountant) beside the accuracy."""
    import json

    paths = []
    for eps, spent in ((1.0, 0.998), (4.0, 3.9)):
        for seed in (0, 1):
            m = {
                "wildcards": {"upstream": "standard", "task": "t", "algo": "dpsgd",
                              "eps": f"{eps:g}", "seed": str(seed)},
                "test_accuracy": 0.8, "test_robust_accuracy": 0.7,
                "privacy": {"epsilon": spent - 0.001 * seed, "delta": 1e-5, "accountant": "prv"},
            }  # fmt: skip
            p = tmp_path / f"{eps}-{seed}.json"
            p.write_text(json.dumps(m))
            paths.append(p)
    aggregate.run(paths, [], ["standard"], tmp_path / "f.csv", tmp_path / "f.md")
    md = (tmp_path / "f.md").read_text()
    assert "δ = 1e-05, accountant prv" in md
    assert "| dpsgd | standard | 0.998 | 3.900 ‡ |" in md  # the largest over seeds; 3.9 < 4
