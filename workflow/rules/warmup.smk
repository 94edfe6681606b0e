rule warmup:
    """Standard training on the public set: the shared start of every trained upstream method."""
    output:
        model=f"{RESULTS}/warmup/model.pt",
        metrics=f"{RESULTS}/warmup/metrics.json",
    params:
        fp=fingerprint("data", "public", "model", "warmup", "seed", "robustness"),
    log:
        "logs/warmup.log",
    benchmark:
        "benchmarks/warmup.tsv"
    threads: workflow.cores
    resources:
        gpu=1,
        mem_mb=8000,
        runtime=240,
    shell:
        "DPADAPTER_THREADS={threads} {PYTHON} -m dpadapter --config {CONFIG_FILE} "
        "warmup --out {RESULTS}/warmup > {log} 2>&1"
