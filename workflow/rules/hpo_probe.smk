# The linear scaling rule in the paper's regime (hpo.regime: linear-probe, the default;
# src/dpadapter/hpo/probe): a zero-initialised linear head on frozen features, full-batch DP-GD
# with momentum.
# Per (upstream, task) of the `hpo` section:
#
#   hpo_features       the checkpoint's frozen features of train / val / test, computed once
#   hpo_probe_oracle   every r of the grid at every sweep and target budget, oracle_seeds seeds
#                      each: the premise check, the grid oracle (tuning NOT accounted) and the
#                      exact expectation of random search over the grid
#   hpo_probe_seed     one HPO replicate: sweeps, accounted and raw selection, r(eps), the final
#                      run at every target; totals recomputed with dp-accounting PLD
#   hpo_probe_summary  results/summary/hpo.{csv,md,json}: premise, RERR with a t-interval
PROBE_DIR = f"{RESULTS}/hpo-probe/{{upstream}}/{{task}}"
PROBE_LOG = f"{RESULTS}/logs/hpo-probe/{{upstream}}/{{task}}"


rule hpo_features:
    """Frozen features (classifier inputs, unit l2 norm) of the task's three splits."""
    input:
        ckpt=f"{RESULTS}/pretrain/{{upstream}}/model.pt",
    output:
        features=f"{PROBE_DIR}/features.pt",
    params:
        **JOB_PARAMS,
        fp=lambda wc: job_fp("hpo-probe", wc),
    log:
        f"{PROBE_LOG}/features.log",
    threads: 1
    conda:
        PIPELINE_ENV
    resources:
        **cpu_job(mem_mb=4000, runtime=30),
    shell:
        "DPADAPTER_THREADS={threads} {params.python} -m dpadapter --config {params.config} hpo "
        "features --task {wildcards.task} --ckpt {input.ckpt} --out {output.features} > {log} 2>&1"


rule hpo_probe_oracle:
    """Grid x budgets x oracle seeds: premise, oracle and random-search expectation."""
    input:
        features=f"{PROBE_DIR}/features.pt",
    output:
        oracle=f"{PROBE_DIR}/oracle.json",
    params:
        **JOB_PARAMS,
        fp=lambda wc: job_fp("hpo-probe", wc),
    log:
        f"{PROBE_LOG}/oracle.log",
    threads: 1
    conda:
        PIPELINE_ENV
    resources:
        **cpu_job(mem_mb=4000, runtime=60),
    shell:
        "DPADAPTER_THREADS={threads} {params.python} -m dpadapter --config {params.config} hpo "
        "probe-oracle --features {input.features} --out {output.oracle} > {log} 2>&1"


rule hpo_probe_seed:
    """One HPO replicate (seed {seed}) at every target budget."""
    input:
        features=f"{PROBE_DIR}/features.pt",
    output:
        run=f"{PROBE_DIR}/seed{{seed}}.json",
    params:
        **JOB_PARAMS,
        fp=lambda wc: job_fp("hpo-probe", wc),
    log:
        f"{PROBE_LOG}/seed{{seed}}.log",
    threads: 1
    conda:
        PIPELINE_ENV
    resources:
        **cpu_job(mem_mb=4000, runtime=30),
    shell:
        "DPADAPTER_THREADS={threads} {params.python} -m dpadapter --config {params.config} hpo "
        "probe-seed --features {input.features} --seed {wildcards.seed} --out {output.run} "
        "> {log} 2>&1"


rule hpo_probe_summary:
    """results/summary/hpo.{csv,md,json}: premise check, then RERR with its interval."""
    input:
        oracle=_probe_expand(f"{PROBE_DIR}/oracle.json"),
        seeds=_probe_expand(f"{PROBE_DIR}/seed{{seed}}.json", seeds=True),
    output:
        csv=f"{RESULTS}/summary/hpo.csv",
        md=f"{RESULTS}/summary/hpo.md",
        json=f"{RESULTS}/summary/hpo.json",
    params:
        **JOB_PARAMS,
    log:
        f"{RESULTS}/logs/hpo-probe/summary.log",
    conda:
        PIPELINE_ENV
    resources:
        **cpu_job(runtime=5),
    shell:
        "{params.python} -m dpadapter --config {params.config} hpo probe-summary "
        "--oracle {input.oracle} --seeds {input.seeds} --csv {output.csv} --md {output.md} "
        "--json {output.json} > {log} 2>&1"
