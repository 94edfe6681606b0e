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


WHY = "skipped: external weights come with a head trained on other classes than the public set's"


def _grid(tmp_path, upstreams):
    """Pre-training metrics (external ones without a public accuracy) and one fine-tuning cell."""
    ft, pre = [], []
    for up, acc in upstreams:
        measured = (
            {}
            if acc is None
            else {"public_test_accuracy": acc, "public_test_robust_accuracy": acc - 0.1}
        )
        pre.append(
            _metrics(
                tmp_path / "pre" / up / "metrics.json",
                wildcards={"upstream": up},
                hyperparameters={},
                **(measured or {"public_report": WHY}),
            )
        )
        ft.append(
            _metrics(
                tmp_path / "ft" / up / "metrics.json",
                wildcards={"upstream": up, "task": "t", "algo": "dpsgd", "eps": "1"},
                test_accuracy=0.5,
                test_robust_accuracy=0.4,
                privacy={"epsilon": 0.9},
            )
        )
    return ft, pre  # fmt: skip


def test_a_grid_of_external_upstreams_only_gets_its_figures_and_says_why(tmp_path):
    """Issue 36, 1: with no public accuracy to place, `figures` raised (no rows to plot) and
    Snakemake deleted the figures it had made; the run of such a config could not finish."""
    ft, pre = _grid(tmp_path, [("vit", None), ("resnet", None)])
    aggregate.run(ft, pre, ["vit", "resnet"], tmp_path / "f.csv", tmp_path / "f.md")
    written = figures.main_figures(tmp_path / "f.csv", pre, ["vit", "resnet"], tmp_path / "out")
    assert [p.name for p in written] == [
        "accuracy_vs_epsilon_dpsgd.png",
        "robustness_vs_accuracy.png",
    ]
    assert all(p.stat().st_size > 1000 for p in written)
    rob = list(csv.DictReader(open(tmp_path / "out" / "robustness_vs_accuracy.csv")))
    assert [(r["upstream"], r["public_test_accuracy"]) for r in rob] == [
        ("vit", ""),
        ("resnet", ""),
    ]
    assert all(r["note"].startswith("external weights come with a head") for r in rob)
    md = (tmp_path / "f.md").read_text()
    assert "| dpsgd | vit | 50.0 (n=1)† | 50.0 | n/a | n/a |" in md, md
    assert "n/a: no public accuracy is measured for vit, resnet: external weights" in md, md


def test_a_mixed_grid_places_what_it_measured_and_names_the_rest(tmp_path):
    ft, pre = _grid(tmp_path, [("scratch", 0.3), ("vit", None)])
    aggregate.run(ft, pre, ["scratch", "vit"], tmp_path / "f.csv", tmp_path / "f.md")
    figures.main_figures(tmp_path / "f.csv", pre, ["scratch", "vit"], tmp_path / "out")
    rob = list(csv.DictReader(open(tmp_path / "out" / "robustness_vs_accuracy.csv")))
    assert [(r["upstream"], r["public_test_accuracy"]) for r in rob] == [
        ("scratch", "0.3"),
        ("vit", ""),
    ]


def test_a_row_of_panels_per_strategy(tmp_path, monkeypatch):
    """finetune.csv of several tuning strategies: the accuracy-against-ε figure has a row of
    panels per strategy, titled with it; one strategy keeps the one row it always had."""
    from dpadapter.ground import plots

    drawn = []
    monkeypatch.setattr(plots, "_save", lambda fig, out: drawn.append(fig) or out)
    rows = [
        {"upstream": u, "task": t, "algorithm": "dpsgd", "strategy": s, "epsilon": e,
         "mean_accuracy": "0.5", "std_accuracy": "0.01"}
        for s in ("ht", "ft", "ut") for u in ("scratch", "standard") for t in ("a", "b")
        for e in ("1", "4")
    ]  # fmt: skip
    plots.accuracy_vs_epsilon(rows, tmp_path / "x.png", algorithm="dpsgd")
    titles = [ax.get_title() for ax in drawn[-1].axes]  # row by row
    assert titles == ["a · ht", "b · ht", "a · ft", "b · ft", "a · ut", "b · ut"]
    plots.accuracy_vs_epsilon([r for r in rows if r["strategy"] == "ft"], tmp_path / "y.png")
    assert [ax.get_title() for ax in drawn[-1].axes] == ["a", "b"]
