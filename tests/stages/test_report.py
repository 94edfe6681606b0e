"""Pages of the Snakemake report: markdown tables become HTML tables that say their source."""

import json
from html.parser import HTMLParser

from dpadapter.stages import report


class _Cells(HTMLParser):
    """Rows of the first HTML table: what a browser would lay out as cells."""

    def __init__(self):
        super().__init__()
        self.rows, self.classes, self._in = [], [], False

    def handle_starttag(self, tag, attrs):
        if tag == "tr":
            self.rows.append([])
        if tag in ("td", "th"):
            self._in = True
            self.rows[-1].append("")
            self.classes.append(dict(attrs).get("class"))

    def handle_endtag(self, tag):
        self._in = self._in and tag not in ("td", "th")

    def handle_data(self, data):
        if self._in:
            self.rows[-1][-1] += data


def _parse(page: str) -> _Cells:
    p = _Cells()
    p.feed(page)
    return p


def test_about_names_config_seeds_accountant_and_delta(tiny_cfg):
    line = report.about(tiny_cfg, "finetune", "configs/x.yaml")
    assert "configs/x.yaml" in line and "results/" in line
    assert "1 seed(s)" in line and "PRV accountant" in line and "δ = 1e-05" in line
    assert "one audited run" in report.about(tiny_cfg, "audit", "c.yaml")


def test_markdown_table_becomes_an_html_table_with_marked_cells():
    md = (
        "Intro with <b>html</b>.\n\n| A | ε=1 | ε=4 |\n|---|---|---|\n"
        "| x | 80.0 ± 1.0 (n=3) | 70.0 ± 1.0 (n=3) ▼ |\n| y | 50.0 (n=1)† | 51.0 (n=1)† |\n"
    )
    page = report.page(md, "T <1>", "Config: c.yaml")
    cells = _parse(page)
    assert cells.rows == [
        ["A", "ε=1", "ε=4"],
        ["x", "80.0 ± 1.0 (n=3)", "70.0 ± 1.0 (n=3) ▼"],
        ["y", "50.0 (n=1)†", "51.0 (n=1)†"],
    ]
    assert cells.classes[5] == "inverted" and cells.classes[7] == "single"
    assert "T &lt;1&gt;" in page and "<b>html</b>" not in page  # escaped, not injected
    assert "Config: c.yaml" in page


def test_upstream_and_speed_tables(tmp_path):
    paths = []
    for up, acc, rob, t in (("standard", 0.9, 0.8, 10.0), ("scratch", 0.2, 0.2, 1.0)):
        p = tmp_path / f"{up}.json"
        m = {"wildcards": {"upstream": up}, "public_test_accuracy": acc,
             "public_test_robust_accuracy": rob, "wall_time_s": t}  # fmt: skip
        p.write_text(json.dumps(m))
        paths.append(p)
    rows = _parse(report.page(report.upstream_markdown(paths, ["scratch", "standard"]), "u", ""))
    assert rows.rows[1:] == [
        ["scratch", "20.0 (n=1)†", "20.0 (n=1)†", "+0.0"],
        ["standard", "90.0 (n=1)†", "80.0 (n=1)†", "-10.0"],
    ]
    ft = []
    for i, t in enumerate((2.0, 4.0)):
        p = tmp_path / f"ft{i}.json"
        p.write_text(json.dumps({"wildcards": {"algo": "dpsgd"}, "wall_time_s": t}))
        ft.append(p)
    rows = _parse(report.page(report.speed_markdown(ft, paths), "s", "")).rows
    assert ["finetune", "", "dpsgd", "3.0 ± 1.4 (n=2)"] in rows
    assert ["pretrain", "", "standard", "10.0 (n=1)†"] in rows


def _metrics(tmp_path, name, payload):
    p = tmp_path / f"{name}.json"
    p.write_text(json.dumps(payload))
    return p


def test_an_external_upstream_says_why_it_has_no_public_accuracy(tmp_path):
    """Issue 36, 8: a bare "–" read as a failed job; the note gives the pre-training job's own
    reason (its metrics.json `public_report`)."""
    why = "skipped: external weights come with a head trained on other classes than the public"
    paths = [
        _metrics(tmp_path, "vit", {"wildcards": {"upstream": "vit"}, "public_report": why}),
        _metrics(tmp_path, "std", {"wildcards": {"upstream": "standard"},
                                   "public_test_accuracy": 0.9,
                                   "public_test_robust_accuracy": 0.8}),
    ]  # fmt: skip
    md = report.upstream_markdown(paths, ["standard", "vit"])
    cells = _parse(report.page(md, "u", "")).rows
    assert cells[2] == ["vit", "n/a", "n/a", "n/a"], cells
    assert "n/a: no public accuracy is measured for vit: external weights come with a head" in md


def test_speed_is_grouped_per_backbone(tmp_path):
    """Issue 36, 8: one mean over a ViT's and a CNN's jobs (76 ± 136 s) described neither."""
    ft = [
        _metrics(tmp_path, f"ft{i}", {"wildcards": {"upstream": up, "algo": "dpsgd"},
                                      "wall_time_s": t})
        for i, (up, t) in enumerate((("vit", 200.0), ("vit", 220.0), ("cnn", 2.0), ("cnn", 4.0)))
    ]  # fmt: skip
    nets = {"vit": "timm:vit_small_patch16_224", "cnn": "cnn-gn"}
    rows = _parse(report.page(report.speed_markdown(ft, [], nets.get), "s", "")).rows
    assert rows[0] == ["Stage", "Backbone", "Algorithm / method", "wall time per job (s)"]
    assert ["finetune", "cnn-gn", "dpsgd", "3.0 ± 1.4 (n=2)"] in rows, rows
    assert ["finetune", "timm:vit_small_patch16_224", "dpsgd", "210.0 ± 14.1 (n=2)"] in rows


def test_the_backbone_of_an_upstream_is_its_external_model_else_the_configs(tiny_raw):
    from dpadapter.settings import from_dict

    tiny_raw["pretrain"] = {
        "methods": ["scratch", "vit"],
        "external": {"vit": {"model": "timm:vit_tiny_patch16_224", "weights": {"hub": True}}},
    }
    cfg = from_dict(tiny_raw)
    assert report.backbone_of(cfg, "vit") == "timm:vit_tiny_patch16_224"
    assert report.backbone_of(cfg, "scratch") == report.backbone_of(cfg, "dpadapter+gamma=1")
    assert report.backbone_of(cfg, "scratch") == "cnn-gn"


def test_the_fine_tuning_page_shows_epsilon_spent_and_marks_an_underspent_cell(tmp_path):
    """Issue 50, item 1: the report's fine-tuning page is finetune.md's tables, the ε spent
    table among them, its `‡` (spent less than the target) coloured like the other marks."""
    from dpadapter.stages import aggregate

    paths = []
    for eps, spent in ((1.0, 0.998), (4.0, 3.9)):
        m = {
            "wildcards": {"upstream": "standard", "task": "t", "algo": "dpsgd",
                          "eps": f"{eps:g}", "seed": "0"},
            "test_accuracy": 0.8, "test_robust_accuracy": 0.7,
            "privacy": {"epsilon": spent, "delta": 1e-5, "accountant": "prv"},
        }  # fmt: skip
        paths.append(tmp_path / f"{eps}.json")
        paths[-1].write_text(json.dumps(m))
    aggregate.run(paths, [], ["standard"], tmp_path / "f.csv", tmp_path / "f.md")
    page = report.page((tmp_path / "f.md").read_text(), "DP fine-tuning", "Config: c.yaml")
    assert "δ = 1e-05, accountant prv" in page
    spent = '<td>dpsgd</td>\n<td>standard</td>\n<td>0.998</td>\n<td class="under">3.900 ‡</td>'
    assert spent in page, page
