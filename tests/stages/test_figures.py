"""Figures are drawn from the pipeline's own outputs, each beside the CSV behind it."""

import csv
import json

from dpadapter.stages import aggregate, figures


def _metrics(path, **kw):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(kw))
    return path


def test_main_and_sweep_figures(tmp_path):
    ft, pre = [], []
    for up, acc in (("scratch", 0.3), ("standard", 0.8), ("dpadapter+gamma=0.5", 0.75)):
        pre.append(
            _metrics(
                tmp_path / "pre" / up / "metrics.json",
                wildcards={"upstream": up},
                public_test_accuracy=acc,
                public_test_robust_accuracy=acc - 0.1,
                hyperparameters={},
            )
        )
        for eps in ("1", "4"):
            for seed in (0, 1):
                ft.append(
                    _metrics(
                        tmp_path / "ft" / up / eps / str(seed) / "metrics.json",
                        wildcards={"upstream": up, "task": "t", "algo": "dpsgd", "eps": eps},
                        test_accuracy=acc - 0.1 + 0.01 * seed,
                        test_robust_accuracy=0.5,
                        privacy={"epsilon": float(eps) * 0.99},
                    )
                )
    out = tmp_path / "figs"
    aggregate.run(ft, pre, ["scratch", "standard"], tmp_path / "f.csv", tmp_path / "f.md")
    written = figures.main_figures(tmp_path / "f.csv", pre, ["scratch", "standard"], out)
    assert all(p.stat().st_size > 1000 for p in written)
    assert (out / "accuracy_vs_epsilon_dpsgd.csv").is_file()
    rob = list(csv.DictReader(open(out / "robustness_vs_accuracy.csv")))
    assert {r["upstream"] for r in rob} == {"scratch", "standard", "dpadapter+gamma=0.5"}
    figures.sweep_figures(pre, ft, out)
    rows = list(csv.DictReader(open(out / "gamma_sweep.csv")))
    assert [(r["gamma"], r["n_seeds"]) for r in rows] == [("0.5", "4")]
    assert (out / "gamma_sweep.png").stat().st_size > 1000
    assert (out / "sam_vs_dpadapter.png").stat().st_size > 1000
