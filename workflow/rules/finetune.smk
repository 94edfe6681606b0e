rule finetune:
    """DP fine-tuning of one upstream checkpoint on one private task at one epsilon and seed."""
    wildcard_constraints:
        # its algorithm, or `algo+strategy` for a tuning strategy besides finetune.strategy
        algo="[a-z0-9-]+(\\+(ft|ht|ut|bitfit))?",
    input:
        ckpt=f"{RESULTS}/pretrain/{{upstream}}/model.pt",
    output:
        metrics=f"{RESULTS}/finetune/{{upstream}}/{{task}}/{{algo}}/eps{{eps}}/seed{{seed}}/metrics.json",
        model=f"{RESULTS}/finetune/{{upstream}}/{{task}}/{{algo}}/eps{{eps}}/seed{{seed}}/model.pt",
    params:
        **JOB_PARAMS,
        fp=lambda wc: job_fp("finetune", wc),
        out=lambda wc, output: str(Path(output.metrics).parent),
    log:
        f"{RESULTS}/logs/finetune/{{upstream}}/{{task}}/{{algo}}/eps{{eps}}/seed{{seed}}.log",
    benchmark:
        f"{RESULTS}/benchmarks/finetune/{{upstream}}/{{task}}/{{algo}}/eps{{eps}}/seed{{seed}}.tsv"
    conda:
        PIPELINE_ENV
    threads: 1
    resources:
        **gpu_job(mem_mb=4000, runtime=120, gpus=FINETUNE_GPUS),
    shell:
        "DPADAPTER_THREADS={threads} {params.python} -m dpadapter --config {params.config} finetune "
        "--upstream {wildcards.upstream} --task {wildcards.task} --algo {wildcards.algo} "
        "--eps {wildcards.eps} --seed {wildcards.seed} --ckpt {input.ckpt} --out {params.out} > {log} 2>&1"
