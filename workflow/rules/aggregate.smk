FINETUNE_METRICS = [
    f"{RESULTS}/finetune/{u}/{t}/{a}/eps{e:g}/seed{s}/metrics.json" for u, t, a, e, s in CFG.finetune_grid()
]


rule aggregate:
    """Mean and std over seeds: finetune.csv and the Table-1-style finetune.md."""
    input:
        finetune=FINETUNE_METRICS,
        pretrain=expand(f"{RESULTS}/pretrain/{{upstream}}/metrics.json", upstream=UPSTREAMS),
    output:
        csv=f"{RESULTS}/summary/finetune.csv",
        md=f"{RESULTS}/summary/finetune.md",
    log:
        "logs/aggregate.log",
    resources:
        gpu=0,
        mem_mb=1000,
        runtime=10,
    shell:
        "{PYTHON} -m dpadapter --config {CONFIG_FILE} aggregate --metrics {input.finetune} "
        "--pretrain {input.pretrain} --csv {output.csv} --md {output.md} > {log} 2>&1"
