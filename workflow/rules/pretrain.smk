rule pretrain:
    """One registered upstream method (scratch, standard, ...) -> a pre-trained checkpoint."""
    input:
        unpack(pretrain_inputs),
    output:
        model=f"{RESULTS}/pretrain/{{upstream}}/model.pt",
        metrics=f"{RESULTS}/pretrain/{{upstream}}/metrics.json",
    params:
        **JOB_PARAMS,
        fp=lambda wc: job_fp("pretrain", wc),
        out=out_dir,
        warmup=lambda wc, input: f"--warmup {input.warmup}" if "warmup" in input.keys() else "",
    log:
        f"{RESULTS}/logs/pretrain/{{upstream}}.log",
    benchmark:
        f"{RESULTS}/benchmarks/pretrain/{{upstream}}.tsv"
    conda:
        PIPELINE_ENV
    threads: workflow.cores
    resources:
        **gpu_job(mem_mb=8000, runtime=720, gpus=PRETRAIN_GPUS),
    shell:
        "DPADAPTER_THREADS={threads} {params.python} -m dpadapter --config {params.config} "
        "pretrain --method {wildcards.upstream} {params.warmup} "
        "--out {params.out} > {log} 2>&1"
