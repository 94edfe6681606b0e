_GRID_KEYS = {"algorithms", "epsilons", "seeds", "extra_grids", "algo_params"}


def finetune_fingerprint(wildcards):
    """Settings one job depends on; the grid's extent (more seeds, another algorithm) is not one."""
    ft = {k: v for k, v in config.get("finetune", {}).items() if k not in _GRID_KEYS}
    algo = config.get("finetune", {}).get("algo_params", {}).get(wildcards.algo, {})
    task = config["tasks"][wildcards.task]
    return fingerprint("data", "privacy", "robustness", "public") + json.dumps(
        [ft, algo, task], sort_keys=True
    )


rule finetune:
    """DP fine-tuning of one upstream checkpoint on one private task at one epsilon and seed."""
    input:
        ckpt=f"{RESULTS}/pretrain/{{upstream}}/model.pt",
    output:
        metrics=f"{RESULTS}/finetune/{{upstream}}/{{task}}/{{algo}}/eps{{eps}}/seed{{seed}}/metrics.json",
        model=f"{RESULTS}/finetune/{{upstream}}/{{task}}/{{algo}}/eps{{eps}}/seed{{seed}}/model.pt",
    params:
        fp=finetune_fingerprint,
        out=lambda wc, output: str(Path(output.metrics).parent),
    log:
        "logs/finetune/{upstream}/{task}/{algo}/eps{eps}/seed{seed}.log",
    benchmark:
        "benchmarks/finetune/{upstream}/{task}/{algo}/eps{eps}/seed{seed}.tsv"
    threads: 1
    resources:
        gpu=1,
        mem_mb=4000,
        runtime=120,
    shell:
        "DPADAPTER_THREADS={threads} {PYTHON} -m dpadapter --config {CONFIG_FILE} finetune "
        "--upstream {wildcards.upstream} --task {wildcards.task} --algo {wildcards.algo} "
        "--eps {wildcards.eps} --seed {wildcards.seed} --ckpt {input.ckpt} --out {params.out} > {log} 2>&1"
