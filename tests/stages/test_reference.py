"""Paper vs ours: the published table beside the measured one, with the paper's ERR."""

import pytest

from dpadapter.config import load
from dpadapter.stages import reference
from dpadapter.stages.aggregate import COLUMNS
from dpadapter.tables import write_csv

REPO = __import__("pathlib").Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("eps, expected", [(1, 3.91), (2, 10.53), (3, 8.80)])
def test_err_reproduces_the_papers_column(eps, expected):
    """DP-SAT Table 2, FashionMNIST / GNResNet-10: ERR from the paper's own accuracies."""
    ref = load(REPO / "configs/dpsat-table2.yaml").reference
    cell = {(c.algorithm, c.epsilon): c.mean for c in ref.cells}
    assert reference.err(cell[("dpsgd", eps)], cell[("dpsat", eps)]) == pytest.approx(
        expected, abs=0.01
    )


def test_table_shows_ours_beside_the_paper_and_missing_cells(tmp_path):
    ref = load(REPO / "configs/dpsat-table2.yaml").reference
    rows = [
        {
            "upstream": "scratch",
            "task": "fmnist",
            "algorithm": a,
            "epsilon": e,
            "mean_accuracy": acc,
            "std_accuracy": 0.01,
            "n_seeds": 1,
            "mean_robust_accuracy": 0.5,
            "mean_epsilon_spent": e,
        }
        for a, e, acc in [("dpsgd", 1.0, 0.80), ("dpsat", 1.0, 0.82), ("dpsgd", 3.0, 0.85)]
    ]
    write_csv(rows, tmp_path / "finetune.csv", COLUMNS)
    table = reference.run(tmp_path / "finetune.csv", ref, tmp_path / "r.csv", tmp_path / "r.md")
    md = (tmp_path / "r.md").read_text()
    assert "80.57 ± 0.25" in md and "80.00 ± 1.00 (1 seed)" in md
    assert "not run" in md  # dpsam everywhere, dpsat at eps 2 and 3
    one = next(r for r in table if r["algorithm"] == "dpsat" and r["epsilon"] == 1.0)
    assert one["ours_mean"] == pytest.approx(82.0) and one["difference"] == pytest.approx(0.67)
    # ERR ours at eps 1: (20 - 18) / 20 = 10 %
    assert "| 1 |" in md and "10.00%" in md
