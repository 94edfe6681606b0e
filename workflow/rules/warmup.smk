rule warmup:
    """Standard training on the public set: the shared start of every trained upstream method."""
    output:
        model=f"{RESULTS}/warmup/model.pt",
        metrics=f"{RESULTS}/warmup/metrics.json",
    params:
        **JOB_PARAMS,
        fp=job_fp("warmup"),
        out=out_dir,
    log:
        f"{RESULTS}/logs/warmup.log",
    benchmark:
        f"{RESULTS}/benchmarks/warmup.tsv"
    conda:
        PIPELINE_ENV
    threads: workflow.cores
    resources:
        **gpu_job(mem_mb=8000, runtime=240, gpus=PRETRAIN_GPUS),
    shell:
        "DPADAPTER_THREADS={threads} {params.python} -m dpadapter --config {params.config} "
        "warmup --out {params.out} > {log} 2>&1"
