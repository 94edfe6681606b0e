# What the Snakemake report (`make report`, workflow/rules/report.smk) needs before the rules
# that make its results are read: the sections, the caption of each figure, and `report_about`,
# the line every caption shows (config, seeds, what ε means; dpadapter.stages.report.about).
# `about` params are functions of `input`, so they are no rerun trigger: adding them re-runs
# nothing.
from dpadapter.stages import report as _report_page

# Numbered so Snakemake, which sorts sections by name, shows them in this order.
REPORT_SECTIONS = {
    "finetune": "1. Fine-tuning",
    "upstream": "2. Upstream robustness",
    "sweeps": "2. Upstream robustness",
    "hpo": "3. HPO",
    "federated": "4. Federated",
    "audit": "5. Audit",
    "validity": "6. Validity",
    "speed": "7. Speed",
}
REPORT_CONFIGS = ", ".join(_CONFIG_FILES) or "config.yaml"


def report_about(*sections):
    """Params `about`: {section: line}; a caption shows `snakemake.params.about[section]`."""

    def about(wildcards, input):
        return {s: _report_page.about(CFG, s, REPORT_CONFIGS) for s in sections}

    return about


def report_made(path):
    """An optional stage is reported once its summary exists, i.e. once it has been run."""
    return Path(path).exists()


def report_figure(path, name, section):
    """A figure under report(): its caption is workflow/report/<name>.rst."""
    return report(
        path,
        caption=f"../report/{name}.rst",
        category=REPORT_SECTIONS[section],
        subcategory="figures",
    )
