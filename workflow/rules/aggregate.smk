FINETUNE_METRICS = [
    f"{RESULTS}/finetune/{u}/{t}/{CFG.finetune.folder(a, st)}/eps{e:g}/seed{s}/metrics.json"
    for u, t, a, e, s, st in CFG.finetune_grid()
]


rule aggregate:
    """Mean and std over seeds: finetune.csv and the Table-1-style finetune.md, with the
    paired differences between upstreams (paired.json: their numbers, for the validity page)."""
    input:
        finetune=FINETUNE_METRICS,
        pretrain=expand(f"{RESULTS}/pretrain/{{upstream}}/metrics.json", upstream=UPSTREAMS),
    output:
        csv=f"{RESULTS}/summary/finetune.csv",
        md=f"{RESULTS}/summary/finetune.md",
        paired=f"{RESULTS}/summary/paired.json",
    params:
        **JOB_PARAMS,
    log:
        f"{RESULTS}/logs/aggregate.log",
    conda:
        PIPELINE_ENV
    resources:
        **cpu_job(),
    shell:
        "{params.python} -m dpadapter --config {params.config} aggregate --metrics {input.finetune} "
        "--pretrain {input.pretrain} --csv {output.csv} --md {output.md} "
        "--paired-json {output.paired} > {log} 2>&1"


FIGURE_ALGOS = list(CFG.grid_algorithms())


rule figures:
    """Downstream accuracy against epsilon per upstream method; robust vs plain accuracy (Fig. 6)."""
    input:
        csv=f"{RESULTS}/summary/finetune.csv",
        pretrain=expand(f"{RESULTS}/pretrain/{{upstream}}/metrics.json", upstream=UPSTREAMS),
    output:
        report_figure(expand(f"{RESULTS}/figures/accuracy_vs_epsilon_{{algo}}.png", algo=FIGURE_ALGOS), "accuracy_vs_epsilon", "finetune"),
        expand(f"{RESULTS}/figures/accuracy_vs_epsilon_{{algo}}.csv", algo=FIGURE_ALGOS),
        report_figure(f"{RESULTS}/figures/robustness_vs_accuracy.png", "robustness_vs_accuracy", "upstream"),
        f"{RESULTS}/figures/robustness_vs_accuracy.csv",
    params:
        **JOB_PARAMS,
        out=out_dir,
        about=report_about("finetune", "upstream"),
    log:
        f"{RESULTS}/logs/figures.log",
    conda:
        PIPELINE_ENV
    resources:
        **cpu_job(),
    shell:
        "{params.python} -m dpadapter --config {params.config} figures --finetune-csv {input.csv} "
        "--pretrain {input.pretrain} --out {params.out} > {log} 2>&1"


REFERENCE_OUT = (
    [f"{RESULTS}/summary/reference.csv", f"{RESULTS}/summary/reference.md"] if CFG.reference else []
)


rule reference:
    """A published table beside ours (config `reference`): paper vs ours, mean ± std, ERR."""
    input:
        csv=f"{RESULTS}/summary/finetune.csv",
    output:
        csv=f"{RESULTS}/summary/reference.csv",
        md=f"{RESULTS}/summary/reference.md",
    params:
        **JOB_PARAMS,
    log:
        f"{RESULTS}/logs/reference.log",
    conda:
        PIPELINE_ENV
    resources:
        **cpu_job(),
    shell:
        "{params.python} -m dpadapter --config {params.config} reference --finetune-csv {input.csv} "
        "--csv {output.csv} --md {output.md} > {log} 2>&1"


rule table_so_far:
    """The tables from the fine-tuning runs finished so far, the others marked as cut (with the
    epoch they resume after) or not run yet: `snakemake table_so_far` prints them and writes
    summary/so-far/ (dpadapter.stages.table_so_far). It declares no output, so it runs whenever
    it is asked for, and it asks for no input, so it starts no other job."""
    localrule: True
    params:
        **JOB_PARAMS,
    log:
        f"{RESULTS}/logs/table_so_far.log",
    conda:
        PIPELINE_ENV
    resources:
        **cpu_job(),
    shell:
        "{params.python} -m dpadapter --config {params.config} table-so-far 2> {log}"
