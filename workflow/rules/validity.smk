# One page of findings (src/dpadapter/stages/validity.py; docs/validity.md): each paper's claim
# with the paper's number, ours with its spread, the setting, and whether it holds. Not part of
# `all`: `make validity` runs what it needs (the main grid, the HPO, the federated grid).


rule validity:
    """results/summary/validity.md from the HPO, federated and fine-tuning summaries."""
    input:
        section_guard("validity"),
        hpo=f"{RESULTS}/summary/hpo.json",
        rule=f"{RESULTS}/summary/federated_rule.json",
        finetune=f"{RESULTS}/summary/finetune.csv",
        paired=f"{RESULTS}/summary/paired.json",
    output:
        md=f"{RESULTS}/summary/validity.md",
    params:
        **JOB_PARAMS,
    log:
        f"{RESULTS}/logs/validity.log",
    conda:
        PIPELINE_ENV
    resources:
        **cpu_job(runtime=5),
    shell:
        "{params.python} -m dpadapter --config {params.config} validity --hpo {input.hpo} "
        "--federated-rule {input.rule} --finetune {input.finetune} --paired {input.paired} "
        "--out {output.md} > {log} 2>&1"
