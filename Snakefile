# Table of contents of the pipeline. Each stage lives in workflow/rules/<stage>.smk and calls an
# entry point of src/dpadapter; common.smk validates the config before anything runs.
#
#   warmup    standard training on the public set (once, shared by every upstream method)
#   pretrain  upstream methods from the registry: scratch, standard, ...
#   finetune  DP fine-tuning over {upstream} x {task} x {algo} x {eps} x {seed}
#   aggregate results/summary/finetune.{csv,md} (Table 1 layout)

# --configfile REPLACES the embedded default instead of being merged into it (Snakemake would
# otherwise merge the two task tables and run both grids).
if not workflow.overwrite_configfiles:

    configfile: "config.yaml"


include: "workflow/rules/common.smk"
include: "workflow/rules/warmup.smk"
include: "workflow/rules/pretrain.smk"
include: "workflow/rules/finetune.smk"
include: "workflow/rules/aggregate.smk"


rule all:
    input:
        f"{RESULTS}/summary/finetune.csv",
        f"{RESULTS}/summary/finetune.md",
    default_target: True
