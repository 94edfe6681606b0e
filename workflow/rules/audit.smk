# Empirical privacy audit (dpadapter.audit, docs/audit.md): one canary run per registered
# algorithm (and federated-<mechanism> of audit.federated, per client) x audit.epsilons, each
# turned into a one-run lower bound on epsilon (Steinke, Nasr & Jagielski 2023). Not part of
# `all`: `snakemake audit` (or `make audit`) builds it.
# The audit section is validated with the rest of the config (dpadapter.validation.compose).
from dpadapter.audit.stage import audit_jobs as _audit_jobs

AUDIT_RECORDS = [f"{RESULTS}/audit/{a}/eps{e:g}/audit.json" for a, e in _audit_jobs(CFG)]


rule audit_run:
    """One audited training run: canaries in, dp_fit as fine-tuning runs it, a lower bound out."""
    output:
        record=f"{RESULTS}/audit/{{algo}}/eps{{eps}}/audit.json",
    params:
        **JOB_PARAMS,
        fp=lambda wc: job_fp("audit", wc),
        out=lambda wc, output: str(Path(output.record).parent),
    log:
        f"{RESULTS}/logs/audit/{{algo}}/eps{{eps}}.log",
    benchmark:
        f"{RESULTS}/benchmarks/audit/{{algo}}/eps{{eps}}.tsv"
    conda:
        PIPELINE_ENV
    threads: 1
    resources:
        **cpu_job(mem_mb=2000, runtime=30),  # a logistic regression: the CPU is faster than a transfer
    shell:
        "DPADAPTER_THREADS={threads} {params.python} -m dpadapter --config {params.config} "
        "audit run --algo {wildcards.algo} --eps {wildcards.eps} --out {params.out} > {log} 2>&1"


rule audit_summary:
    """audit.csv, audit.md and the lower-bound-vs-claim figure."""
    input:
        AUDIT_RECORDS,
    output:
        csv=f"{RESULTS}/summary/audit.csv",
        md=f"{RESULTS}/summary/audit.md",
        fig=report_figure(f"{RESULTS}/figures/audit_lower_bound.png", "audit_lower_bound", "audit"),
    params:
        **JOB_PARAMS,
        about=report_about("audit"),
    log:
        f"{RESULTS}/logs/audit_summary.log",
    conda:
        PIPELINE_ENV
    resources:
        **cpu_job(),
    shell:
        "{params.python} -m dpadapter --config {params.config} audit summary "
        "--records {input} --csv {output.csv} --md {output.md} --fig {output.fig} > {log} 2>&1"


rule audit:
    """Target: every algorithm x epsilon audited, and the table (not part of `all`)."""
    input:
        section_guard("audit"),
        rules.audit_summary.output,
