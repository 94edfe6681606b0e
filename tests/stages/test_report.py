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
    assert ["finetune", "dpsgd", "3.0 ± 1.4 (n=2)"] in rows
    assert ["pretrain", "standard", "10.0 (n=1)†"] in rows
