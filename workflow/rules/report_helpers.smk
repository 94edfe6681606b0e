# What the Snakemake report (`make report`, workflow/rules/report.smk) needs before the rules
# that make its results are read: the sections, the caption of each figure, and `report_about`,
# the line every caption shows (config, seeds, what ε means; dpadapter.stages.report.about).
# `about` params are functions of `input`, so they are no rerun trigger: adding them re-runs
# nothing.
from dpadapter.stages import report as _report_page


def report_made(path):
    """An optional stage is reported once its summary exists, i.e. once it has been run."""
    return Path(path).exists()


# The sections the report shows (an optional stage's once its summary is on disk, as
# report.smk includes its pages), numbered in order without gaps (dpadapter.stages.report).
REPORT_SHOWN = {"finetune", "upstream", "speed"} | {
    section
    for section, summary in (
        ("hpo", "summary/hpo.md"),
        ("federated", "summary/federated_rule.json"),
        ("audit", "summary/audit.md"),
        ("validity", "summary/validity.md"),
    )
    if report_made(f"{RESULTS}/{summary}")
}
REPORT_SECTIONS = _report_page.section_titles(REPORT_SHOWN)
REPORT_CONFIGS = ", ".join(_CONFIG_FILES) or "config.yaml"


def report_about(*sections):
    """Params `about`: {section: line}; a caption shows `snakemake.params.about[section]`."""

    def about(wildcards, input):
        return {s: _report_page.about(CFG, s, REPORT_CONFIGS) for s in sections}

    return about


def report_figure(path, name, section):
    """A figure under report(): its caption is workflow/report/<name>.rst."""
    return report(
        path,
        caption=f"../report/{name}.rst",
        category=REPORT_SECTIONS[section],
        subcategory="figures",
    )
