rule warmup:
    """Standard training on the public set: the shared start of every trained upstream method."""
    output:
        model=f"{RESULTS}/warmup/model.pt",
        metrics=f"{RESULTS}/warmup/metrics.json",
    params:
        fp=stage_fingerprint(config, "warmup"),
        python=python_exe,
        config=config_file,
        out=out_dir,
    log:
        f"{RESULTS}/logs/warmup.log",
    benchmark:
        f"{RESULTS}/benchmarks/warmup.tsv"
    conda:
        "../../envs/pipeline.yaml"
    threads: workflow.cores
    resources:
        gpu=1,
        mem_mb=8000,
        runtime=240,
    shell:
        "DPADAPTER_THREADS={threads} {params.python} -m dpadapter --config {params.config} "
        "warmup --out {params.out} > {log} 2>&1"
