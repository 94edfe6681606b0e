"""Pages of the Snakemake report (`make report`): every summary table as an HTML page.

Snakemake's report shows a result inline only when it is an image, a PDF or an HTML page (a CSV
or a markdown file is a download link), so each summary table is rendered here to a small
standalone HTML page from the same markdown the pipeline prints: one source for the printed
table and the report's. Two tables have no markdown of their own and are made here: the
upstream models' public accuracy and robustness, and the wall time of the training jobs.

`about` is the line every page and caption carries: which config, how many seeds, and what ε
means (accountant, δ), so a page mailed on its own still says where it came from.
"""

from __future__ import annotations

import html
import json
import re
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

from dpadapter.ground.tables import (
    NOT_MEASURED,
    SINGLE,
    Stat,
    absence_note,
    cell,
    how_to_read,
    public_absence,
)
from dpadapter.settings import Config, join_folder

_ACCOUNTANTS = {"prv": "PRV accountant (Opacus)", "rdp": "RDP accountant (Opacus)"}

# How many seeds or runs stand behind a cell, per section of the report.
_SEEDS = {
    "finetune": lambda c: (
        f"{len(c.finetune.seeds)} seed(s) per cell of the main grid "
        "(extra grids: their own; each cell says its n)"
    ),
    "upstream": lambda c: f"one pre-training run per upstream method (seed {c.seed})",
    "hpo": lambda c: f"{len(c.hpo.seeds)} HPO seed(s)",
    "federated": lambda c: f"{len(c.federated.seeds)} seed(s) per cell",
    "audit": lambda c: "one audited run per algorithm and ε",
    "sweeps": lambda c: f"{len(c.sweeps.seeds)} seed(s) per γ",
    "speed": lambda c: "every training job of the main grid",
    "validity": lambda c: "as each claim says",
}


# The report's sections in order: (key, title); `sweeps` pages go under `upstream`.
SECTIONS = (
    ("finetune", "Fine-tuning"),
    ("upstream", "Upstream robustness"),
    ("hpo", "HPO"),
    ("federated", "Federated"),
    ("audit", "Audit"),
    ("validity", "Validity"),
    ("speed", "Speed"),
)
_UNDER = {"sweeps": "upstream"}


def section_titles(present: set[str]) -> dict[str, str]:
    """Section key -> its title, numbered 1, 2, 3, ... over the sections the report shows
    (`present`), so Snakemake, which sorts sections by name, shows them in this order without
    gaps; a section not shown gets the number after the last."""
    shown = [k for k, _ in SECTIONS if k in present]
    rest = [k for k, _ in SECTIONS if k not in present]
    titles = dict(SECTIONS)
    out = {k: f"{i}. {titles[k]}" for i, k in enumerate(shown + rest, start=1)}
    return {**out, **{k: out[v] for k, v in _UNDER.items()}}


def about(cfg: Config, section: str, config_names: str) -> str:
    """Config, seeds and the meaning of ε, in one line."""
    p = cfg.privacy
    acc = _ACCOUNTANTS.get(p.accountant, p.accountant)
    return (
        f"Config: {config_names} (results in {cfg.results_dir}/). "
        f"Seeds: {_SEEDS[section](cfg)}. "
        f"ε: an upper bound on the privacy loss over every step taken, from the {acc} "
        f"at δ = {p.delta:g} (docs/privacy.md)."
    )


_CSS = """
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #111; }
table { border-collapse: collapse; margin: 0.8em 0; font-size: 0.9em; }
th, td { border: 1px solid #bbb; padding: 0.25em 0.6em; text-align: right; }
th { background: #eee; }
td:first-child, td:nth-child(2), th:first-child, th:nth-child(2) { text-align: left; }
td.inverted { background: #fbd5d5; }
td.noise { background: #fdf3d0; }
td.single { color: #666; }
td.under { background: #dce9fb; }
p.about { color: #444; font-size: 0.9em; border-left: 3px solid #999; padding-left: 0.6em; }
"""

# The marks of dpadapter.ground.tables, coloured so they are seen before they are read; `‡`
# (aggregate.UNDER: a cell that spent less ε than its target) as well (issue 50).
_MARKS = (("▼", "inverted"), ("≈", "noise"), ("?", "noise"), (SINGLE, "single"), ("‡", "under"))


def _mark_cells(body: str) -> str:
    def sub(m: re.Match) -> str:
        text = m.group(2)
        cls = next((c for mark, c in _MARKS if text.rstrip().endswith(mark)), None)
        return f'<td{m.group(1)} class="{cls}">{text}</td>' if cls else m.group(0)

    return re.sub(r"<td([^>]*)>(.*?)</td>", sub, body)


def page(markdown: str, title: str, about_line: str) -> str:
    """A standalone HTML page of one summary (markdown tables rendered as HTML tables)."""
    from markdown_it import MarkdownIt

    body = MarkdownIt("commonmark", {"html": False}).enable("table").render(markdown)
    return (
        '<!DOCTYPE html>\n<html><head><meta charset="utf-8">'
        f"<title>{html.escape(title)}</title><style>{_CSS}</style></head><body>\n"
        f'<h1>{html.escape(title)}</h1>\n<p class="about">{html.escape(about_line)}</p>\n'
        f"{_mark_cells(body)}</body></html>\n"
    )


def _metrics(paths: list[Path]) -> list[dict]:
    return [json.loads(Path(p).read_text()) for p in paths]


def upstream_markdown(pretrain: list[Path], order: list[str]) -> str:
    """Public accuracy and robust accuracy of each upstream model (one pre-training run each)."""
    by = {m["wildcards"]["upstream"]: m for m in _metrics(pretrain)}
    names = [u for u in order if u in by] + sorted(u for u in by if u not in order)
    lines = [
        "Public test accuracy (%) of each upstream model, and its robust accuracy (Gaussian noise "
        "on all weights, the noise of `robustness`): what pre-training hands to DP fine-tuning.",
        "",
        "| Upstream | public acc | public robust acc | robust − plain |",
        "|---|---|---|---|",
    ]
    absent: dict[str, str] = {}
    for u in names:
        m = by[u]
        if public_absence(m) is not None:  # external weights: their head is not the public one
            absent[u] = public_absence(m)
            lines.append(f"| {u} | {NOT_MEASURED} | {NOT_MEASURED} | {NOT_MEASURED} |")
            continue
        a, r = m["public_test_accuracy"], m["public_test_robust_accuracy"]
        lines.append(
            f"| {u} | {cell(Stat(a, 0.0, 1))} | {cell(Stat(r, 0.0, 1))} | {100 * (r - a):+.1f} |"
        )
    if absent:
        lines += ["", absence_note(absent)]
    lines += ["", how_to_read("accuracy (%)", "pre-training runs", upper_bounds=False)]
    return "\n".join(lines) + "\n"


def backbone_of(cfg: Config, upstream: str) -> str:
    """The model an upstream's jobs train: an external upstream's own, else `model.name`."""
    from dpadapter.upstream.resolve import EXTERNAL, resolve

    try:
        entry, params, _ = resolve(upstream, cfg.upstream_params, cfg.external_upstreams)
    except (KeyError, ValueError):
        return cfg.model.name
    return str(params.get("model", cfg.model.name)) if entry.name == EXTERNAL else cfg.model.name


def speed_markdown(
    finetune: list[Path], pretrain: list[Path], backbone: Callable[[str], str] | None = None
) -> str:
    """Wall time of the training jobs (seconds, from each job's metrics.json), per backbone.

    A ViT and a small CNN differ by orders of magnitude, so one mean over both describes
    neither: jobs are grouped by the model they train (`backbone` maps an upstream name to it).
    """
    model = backbone or (lambda u: "")
    groups: dict[tuple[str, str, str], list[float]] = defaultdict(list)
    for m in _metrics(pretrain):
        up = m["wildcards"]["upstream"]
        groups[("pretrain", model(up), up)].append(m["wall_time_s"])
    for m in _metrics(finetune):
        w = m["wildcards"]
        algo = join_folder(w["algo"], w.get("strategy"))  # a strategy's jobs apart (ht: fast)
        groups[("finetune", model(w.get("upstream", "")), algo)].append(m["wall_time_s"])
    lines = [
        "Wall time (s) of one training job, mean ± std over the jobs of each kind (every "
        "upstream method on that backbone, task, ε and seed of that algorithm), as it ran "
        "under `make run` (jobs share the machine, so this is the time a user waits, not an "
        "isolated benchmark; docs/speed.md has those).",
        "",
        "| Stage | Backbone | Algorithm / method | wall time per job (s) |",
        "|---|---|---|---|",
    ]
    for (stage, net, name), ts in sorted(groups.items()):
        lines.append(f"| {stage} | {net} | {name} | {cell(Stat.of(ts), scale=1.0, digits=1)} |")
    lines += ["", how_to_read("wall time (s)", "jobs", upper_bounds=False)]
    return "\n".join(lines) + "\n"


def run(
    cfg: Config,
    kind: str,
    inputs: list[Path],
    out: Path,
    title: str,
    section: str,
    config_names: str,
    pretrain: list[Path] | None = None,
) -> Path:
    """One report page: `markdown` renders inputs[0]; `upstream` and `speed` build a table."""
    if kind == "markdown":
        md = Path(inputs[0]).read_text()
    elif kind == "upstream":
        md = upstream_markdown(inputs, list(cfg.upstreams))
    elif kind == "speed":
        md = speed_markdown(inputs, pretrain or [], lambda u: backbone_of(cfg, u))
    else:
        raise ValueError(f"unknown report page kind {kind!r}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page(md, title, about(cfg, section, config_names)))
    return out
