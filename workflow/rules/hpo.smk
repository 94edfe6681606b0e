# Private HPO with the linear scaling rule (src/dpadapter/hpo). Not part of `all`: run the
# `hpo` target (`make hpo`). Per (upstream, task, algorithm, seed) of the `hpo` config section:
#
#   hpo_plan      every privacy parameter fixed before data is read; MLflow parent run
#   hpo_trial     n trials per sweep budget (eps1, eps2[, eps3]), scored on validation
#   hpo_sweep     private selection of each sweep's best r
#   hpo_fit       r(eps) through the best r's; r* for the final budget, clamped to the grid
#   hpo_final     train at e_f with r*; PLD total of trials + selections + final <= target
#   random_search one run at a random r with the whole budget (baseline)
#   grid_run      every r of the grid at the whole budget; grid_oracle picks the best (one
#                 grid per upstream/task/algorithm, trained with the first HPO seed's plan)
#   hpo_summary   results/summary/hpo.{csv,md} (Table 3 analogue, RERR)
# That is `hpo.regime: network` (src/dpadapter/hpo/network). `linear-probe` (the paper's regime,
# the default) runs the rules of hpo_probe.smk instead; both write results/summary/hpo.{csv,md}.
include: "hpo_helpers.smk"
include: "hpo_probe.smk"


if CFG.hpo.regime == "linear-probe":

    ruleorder: hpo_probe_summary > hpo_summary

else:

    ruleorder: hpo_summary > hpo_probe_summary


rule hpo_plan:
    """Trials' (r, lr, T) from the seed, their planned sigma, and the final budget e_f."""
    output:
        plan=f"{HPO_DIR}/plan.json",
    params:
        **JOB_PARAMS,
        fp=lambda wc: job_fp("hpo", wc),
    log:
        f"{HPO_LOG}/plan.log",
    threads: 1
    conda:
        PIPELINE_ENV
    resources:
        **cpu_job(mem_mb=2000, runtime=30),
    shell:
        "DPADAPTER_THREADS={threads} {params.python} -m dpadapter --config {params.config} hpo plan "
        "--upstream {wildcards.upstream} --task {wildcards.task} --algo {wildcards.algo} "
        "--seed {wildcards.seed} --out {output.plan} > {log} 2>&1"


rule hpo_trial:
    """One trial of sweep {sweep} (its budget is hpo.sweep_epsilons[sweep])."""
    wildcard_constraints:
        sweep="[0-9]+",
        trial="[0-9]+",
    input:
        plan=f"{HPO_DIR}/plan.json",
        ckpt=f"{RESULTS}/pretrain/{{upstream}}/model.pt",
    output:
        metrics=f"{HPO_DIR}/trials/s{{sweep}}/t{{trial}}/metrics.json",
    params:
        **JOB_PARAMS,
        out=lambda wc, output: str(Path(output.metrics).parent),
    log:
        f"{HPO_LOG}/trials/s{{sweep}}/t{{trial}}.log",
    benchmark:
        f"{HPO_BENCH}/trials/s{{sweep}}/t{{trial}}.tsv"
    threads: 1
    conda:
        PIPELINE_ENV
    resources:
        **gpu_job(mem_mb=4000, runtime=60, gpus=FINETUNE_GPUS),
    shell:
        "DPADAPTER_THREADS={threads} {params.python} -m dpadapter --config {params.config} hpo trial "
        "--plan {input.plan} --sweep {wildcards.sweep} --trial {wildcards.trial} "
        "--ckpt {input.ckpt} --out {params.out} > {log} 2>&1"


rule hpo_sweep:
    """Private selection (hpo.selection) of sweep {sweep}'s best trial."""
    wildcard_constraints:
        sweep="[0-9]+",
    input:
        plan=f"{HPO_DIR}/plan.json",
        trials=lambda wc: _trial_paths(wc, [int(wc.sweep)]),
    output:
        sweep=f"{HPO_DIR}/sweep{{sweep}}.json",
    params:
        **JOB_PARAMS,
    log:
        f"{HPO_LOG}/sweep{{sweep}}.log",
    conda:
        PIPELINE_ENV
    resources:
        **cpu_job(runtime=5),
    shell:
        "{params.python} -m dpadapter --config {params.config} hpo sweep --plan {input.plan} "
        "--sweep {wildcards.sweep} --trials {input.trials} --out {output.sweep} > {log} 2>&1"


rule hpo_fit:
    """r(eps) through the sweeps' best r (hpo.fit); r* at the final budget, clamped."""
    input:
        plan=f"{HPO_DIR}/plan.json",
        sweeps=expand(f"{HPO_DIR}/sweep{{k}}.json", k=HPO_SWEEPS, allow_missing=True),
    output:
        fit=f"{HPO_DIR}/fit.json",
    params:
        **JOB_PARAMS,
    log:
        f"{HPO_LOG}/fit.log",
    conda:
        PIPELINE_ENV
    resources:
        **cpu_job(runtime=5),
    shell:
        "{params.python} -m dpadapter --config {params.config} hpo fit --plan {input.plan} "
        "--sweeps {input.sweeps} --out {output.fit} > {log} 2>&1"


rule hpo_final:
    """The final run at e_f with r*; its metrics.json carries the HPO's total epsilon."""
    input:
        plan=f"{HPO_DIR}/plan.json",
        fit=f"{HPO_DIR}/fit.json",
        sweeps=expand(f"{HPO_DIR}/sweep{{k}}.json", k=HPO_SWEEPS, allow_missing=True),
        trials=_trial_paths,
        ckpt=f"{RESULTS}/pretrain/{{upstream}}/model.pt",
    output:
        metrics=f"{HPO_DIR}/linear_scaling/metrics.json",
        model=f"{HPO_DIR}/linear_scaling/model.pt",
    params:
        **JOB_PARAMS,
        out=lambda wc, output: str(Path(output.metrics).parent),
    log:
        f"{HPO_LOG}/final.log",
    benchmark:
        f"{HPO_BENCH}/final.tsv"
    threads: 1
    conda:
        PIPELINE_ENV
    resources:
        **gpu_job(mem_mb=4000, runtime=60, gpus=FINETUNE_GPUS),
    shell:
        "DPADAPTER_THREADS={threads} {params.python} -m dpadapter --config {params.config} hpo final "
        "--plan {input.plan} --fit {input.fit} --sweeps {input.sweeps} --trials {input.trials} "
        "--ckpt {input.ckpt} --out {params.out} > {log} 2>&1"


rule random_search:
    """Baseline: one run with the whole budget at a random r of the same grid."""
    input:
        plan=f"{HPO_DIR}/plan.json",
        ckpt=f"{RESULTS}/pretrain/{{upstream}}/model.pt",
    output:
        metrics=f"{HPO_DIR}/random_search/metrics.json",
        model=f"{HPO_DIR}/random_search/model.pt",
    params:
        **JOB_PARAMS,
        out=lambda wc, output: str(Path(output.metrics).parent),
    log:
        f"{HPO_LOG}/random_search.log",
    benchmark:
        f"{HPO_BENCH}/random_search.tsv"
    threads: 1
    conda:
        PIPELINE_ENV
    resources:
        **gpu_job(mem_mb=4000, runtime=60, gpus=FINETUNE_GPUS),
    shell:
        "DPADAPTER_THREADS={threads} {params.python} -m dpadapter --config {params.config} hpo "
        "random-search --plan {input.plan} --ckpt {input.ckpt} --out {params.out} > {log} 2>&1"


rule grid_run:
    """One point of the r grid at the whole budget (a candidate of the oracle)."""
    wildcard_constraints:
        point="[0-9]+",
    input:
        plan=HPO_GRID_PLAN,
        ckpt=f"{RESULTS}/pretrain/{{upstream}}/model.pt",
    output:
        metrics=f"{HPO_GRID_DIR}/grid/p{{point}}/metrics.json",
    params:
        **JOB_PARAMS,
        out=lambda wc, output: str(Path(output.metrics).parent),
    log:
        f"{RESULTS}/logs/hpo/{{upstream}}/{{task}}/{{algo}}/grid/p{{point}}.log",
    benchmark:
        f"{RESULTS}/benchmarks/hpo/{{upstream}}/{{task}}/{{algo}}/grid/p{{point}}.tsv"
    threads: 1
    conda:
        PIPELINE_ENV
    resources:
        **gpu_job(mem_mb=4000, runtime=60, gpus=FINETUNE_GPUS),
    shell:
        "DPADAPTER_THREADS={threads} {params.python} -m dpadapter --config {params.config} hpo grid-run "
        "--plan {input.plan} --point {wildcards.point} --ckpt {input.ckpt} --out {params.out} "
        "> {log} 2>&1"


rule grid_oracle:
    """Baseline: the best grid point (raw validation; tuning cost NOT accounted, labelled)."""
    input:
        plan=HPO_GRID_PLAN,
        runs=expand(f"{HPO_GRID_DIR}/grid/p{{j}}/metrics.json", j=HPO_POINTS, allow_missing=True),
    output:
        oracle=f"{HPO_GRID_DIR}/grid_oracle.json",
    params:
        **JOB_PARAMS,
    log:
        f"{RESULTS}/logs/hpo/{{upstream}}/{{task}}/{{algo}}/grid_oracle.log",
    conda:
        PIPELINE_ENV
    resources:
        **cpu_job(runtime=5),
    shell:
        "{params.python} -m dpadapter --config {params.config} hpo grid-oracle --plan {input.plan} "
        "--runs {input.runs} --out {output.oracle} > {log} 2>&1"


rule hpo_summary:
    """results/summary/hpo.{csv,md}: linear scaling vs random search vs grid oracle, RERR."""
    input:
        final=_hpo_expand(f"{HPO_DIR}/linear_scaling/metrics.json"),
        random=_hpo_expand(f"{HPO_DIR}/random_search/metrics.json"),
        oracle=_hpo_expand(f"{HPO_GRID_DIR}/grid_oracle.json"),
    output:
        csv=f"{RESULTS}/summary/hpo.csv",
        md=f"{RESULTS}/summary/hpo.md",
    params:
        **JOB_PARAMS,
    log:
        f"{RESULTS}/logs/hpo/summary.log",
    conda:
        PIPELINE_ENV
    resources:
        **cpu_job(runtime=5),
    shell:
        "{params.python} -m dpadapter --config {params.config} hpo summary --final {input.final} "
        "--random {input.random} --oracle {input.oracle} --csv {output.csv} --md {output.md} "
        "> {log} 2>&1"


rule hpo:
    """Target: the HPO comparison (not part of `all`), in the configured hpo.regime."""
    input:
        section_guard("hpo"),
        _hpo_target,
