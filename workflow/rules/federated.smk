# DP federated fine-tuning (Pretrain-DPFL): {upstream} x federated.strategies x {mechanism} x
# {eps} x {rounds} x {seed}; `scratch` runs once on the random-init checkpoint. Not part of `all`:
# `snakemake federated` (or `make federated`) builds it.

FED_METRICS = [
    f"{RESULTS}/federated/{u}/{s}/{m}/eps{e:g}/T{t}/seed{seed}/metrics.json"
    for u, s, m, e, t, seed in CFG.federated.jobs(CFG.upstreams)
]


rule federated_run:
    """One DP federated fine-tuning run: every client clips and noises its own updates."""
    input:
        # ancient(): a checkpoint restored by `dvc pull` is newer than what was built from it.
        ckpt=ancient(f"{RESULTS}/pretrain/{{upstream}}/model.pt"),
    output:
        metrics=f"{RESULTS}/federated/{{upstream}}/{{strategy}}/{{mechanism}}/eps{{eps}}/T{{rounds}}/seed{{seed}}/metrics.json",
    wildcard_constraints:
        strategy="scratch|ht|ft|ut|bitfit",
        mechanism="gaussian|laplace",
        rounds="[0-9]+",
    params:
        **JOB_PARAMS,
        fp=lambda wc: job_fp("federated", wc),
        out=lambda wc, output: str(Path(output.metrics).parent),
    log:
        f"{RESULTS}/logs/federated/{{upstream}}/{{strategy}}/{{mechanism}}/eps{{eps}}/T{{rounds}}/seed{{seed}}.log",
    benchmark:
        f"{RESULTS}/benchmarks/federated/{{upstream}}/{{strategy}}/{{mechanism}}/eps{{eps}}/T{{rounds}}/seed{{seed}}.tsv"
    conda:
        PIPELINE_ENV
    threads: 1
    resources:
        **cpu_job(mem_mb=2000, runtime=60),  # the simulation runs on the CPU
    shell:
        "DPADAPTER_THREADS={threads} {params.python} -m dpadapter --config {params.config} "
        "federated run --upstream {wildcards.upstream} --strategy {wildcards.strategy} "
        "--mechanism {wildcards.mechanism} --eps {wildcards.eps} --rounds {wildcards.rounds} "
        "--seed {wildcards.seed} --ckpt {input.ckpt} --out {params.out} > {log} 2>&1"


rule federated_summary:
    """federated.csv, the T1 rule's hit rate, and the Fig. 1-3 analogues."""
    input:
        FED_METRICS,
    output:
        csv=f"{RESULTS}/summary/federated.csv",
        rule=f"{RESULTS}/summary/federated_rule.json",
        eps=report_figure(f"{RESULTS}/figures/federated_accuracy_vs_epsilon.png", "federated_accuracy_vs_epsilon", "federated"),
        rounds=report_figure(f"{RESULTS}/figures/federated_accuracy_vs_rounds.png", "federated_accuracy_vs_rounds", "federated"),
        md=f"{RESULTS}/summary/federated.md",
    params:
        **JOB_PARAMS,
        about=report_about("federated"),
    log:
        f"{RESULTS}/logs/federated_summary.log",
    conda:
        PIPELINE_ENV
    resources:
        **cpu_job(),
    shell:
        "{params.python} -m dpadapter --config {params.config} federated summary "
        "--metrics {input} --csv {output.csv} --rule {output.rule} --fig-eps {output.eps} "
        "--fig-rounds {output.rounds} --md {output.md} > {log} 2>&1"


rule federated:
    """Target: the whole federated grid and its summary (not part of `all`)."""
    input:
        section_guard("federated"),
        rules.federated_summary.output,
