# Table of contents of the pipeline. Each stage lives in workflow/rules/<stage>.smk and calls an
# entry point of src/dpadapter; common.smk validates the config before anything runs.
#
#   warmup    standard training on the public set (once, shared by every upstream method)
#   pretrain  upstream methods from the registry: scratch, standard, ...
#   finetune  DP fine-tuning over {upstream} x {task} x {algo} x {eps} x {seed}
#   aggregate results/summary/finetune.{csv,md} (Table 1 layout) and results/figures/
#   sweeps    gamma sweeps of SAM and DPAdapter, Figs. 5-6 (own target: `snakemake sweeps`)
#   hpo       private HPO, linear scaling rule vs. baselines (own target: `snakemake hpo`)
#   audit     empirical privacy audit, one canary run per algorithm x eps (`snakemake audit`)
#   report    every table and figure that exists, as pages of the Snakemake report (`make report`)

from dpadapter.workflow import snakemake_adapter as _smk

# The few Snakemake internals the workflow reads all go through dpadapter.workflow.snakemake_adapter,
# which stops here, saying what to do, under a Snakemake it was not checked on.
_smk.check_version()

# The front page of `snakemake --report` (make report).
report: "workflow/report/workflow.rst"


# --configfile REPLACES the embedded default instead of being merged into it (Snakemake would
# otherwise merge the two task tables and run both grids).
if not _smk.replaces_default_config(workflow):

    configfile: "config.yaml"


include: "workflow/rules/common.smk"
include: "workflow/rules/report_helpers.smk"
include: "workflow/rules/warmup.smk"
include: "workflow/rules/pretrain.smk"
include: "workflow/rules/finetune.smk"
include: "workflow/rules/aggregate.smk"
include: "workflow/rules/sweeps.smk"
include: "workflow/rules/hpo.smk"
include: "workflow/rules/federated.smk"
include: "workflow/rules/validity.smk"
include: "workflow/rules/audit.smk"
include: "workflow/rules/report.smk"


rule all:
    input:
        section_warning,
        f"{RESULTS}/summary/finetune.csv",
        f"{RESULTS}/summary/finetune.md",
        rules.figures.output,
        REFERENCE_OUT,
    default_target: True
