# The Snakemake report (`make report`): every summary table as an HTML page
# (dpadapter.stages.report; Snakemake shows HTML and images inline, a CSV or markdown file only
# as a download) and the figures, marked with report_figure() in their own rules. `report_all`
# is the main grid plus every optional summary already on disk (HPO, federated, audit,
# validity, the gamma sweeps): `make report` builds it, then runs
# `snakemake --report <results_dir>/report.html report_all`.
PRETRAIN_METRICS = expand(f"{RESULTS}/pretrain/{{upstream}}/metrics.json", upstream=UPSTREAMS)


# page: (section, subcategory, title, kind, inputs, pre-training metrics)
REPORT_PAGES = {
    "finetune": ("finetune", "tables", "DP fine-tuning: test accuracy (Table 1 layout)",
                 "markdown", [f"{RESULTS}/summary/finetune.md"], []),
    "upstream": ("upstream", "tables", "Upstream models: public accuracy and robustness",
                 "upstream", PRETRAIN_METRICS, []),
    "speed": ("speed", "tables", "Wall time of the training jobs", "speed", FINETUNE_METRICS,
              PRETRAIN_METRICS),
}
if CFG.reference:
    REPORT_PAGES["reference"] = ("finetune", "paper vs ours", CFG.reference.name, "markdown",
                                 [f"{RESULTS}/summary/reference.md"], [])
if "hpo" in REPORT_SHOWN:
    REPORT_PAGES["hpo"] = ("hpo", "tables", "Private HPO: the linear scaling rule", "markdown",
                           [f"{RESULTS}/summary/hpo.md"], [])
if "federated" in REPORT_SHOWN:
    REPORT_PAGES["federated"] = ("federated", "tables", "DP federated fine-tuning", "markdown",
                                 [f"{RESULTS}/summary/federated.md"], [])
if "audit" in REPORT_SHOWN:
    REPORT_PAGES["audit"] = ("audit", "tables", "Empirical privacy audit", "markdown",
                             [f"{RESULTS}/summary/audit.md"], [])
if "validity" in REPORT_SHOWN:
    REPORT_PAGES["validity"] = ("validity", "tables", "Validity: each paper's claim, tested",
                                "markdown", [f"{RESULTS}/summary/validity.md"], [])

for _page, (_section, _sub, _title, _kind, _inputs, _pre) in REPORT_PAGES.items():

    rule:
        name:
            f"report_{_page}"
        input:
            inputs=_inputs,
            pretrain=_pre,
        output:
            page=report(
                f"{RESULTS}/report/{_page}.html",
                caption=f"../report/{_page}.rst",
                category=REPORT_SECTIONS[_section],
                subcategory=_sub,
            ),
        params:
            **JOB_PARAMS,
            kind=_kind,
            title=_title,
            section=_section,
            names=lambda wc, input: REPORT_CONFIGS,
            about=report_about(_section),
        log:
            f"{RESULTS}/logs/report/{_page}.log",
        conda:
            PIPELINE_ENV
        resources:
            **cpu_job(runtime=5),
        shell:
            "{params.python} -m dpadapter --config {params.config} report-page --kind {params.kind} "
            "--inputs {input.inputs} --pretrain {input.pretrain} --title {params.title:q} "
            "--section {params.section} --config-names {params.names:q} --out {output.page} "
            "> {log} 2>&1"


REPORT_FIGURES = list(rules.figures.output)
for _summary, _rule in (
    ("figures/gamma_sweep.png", rules.sweeps),
    ("summary/federated_rule.json", rules.federated_summary),
    ("summary/audit.md", rules.audit_summary),
):
    if report_made(f"{RESULTS}/{_summary}"):
        REPORT_FIGURES += list(_rule.output)


rule report_all:
    """Target of `make report`: every page and figure of the report, brought up to date."""
    input:
        section_warning,
        [f"{RESULTS}/report/{p}.html" for p in REPORT_PAGES],
        REPORT_FIGURES,
