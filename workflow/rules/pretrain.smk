from dpadapter.upstream import UPSTREAMS as _UPSTREAM_REGISTRY
from dpadapter.upstream.variants import parse_variant


def pretrain_fingerprint(wildcards):
    """Config a method depends on: shared sections, its own params and those of a matched method."""
    params = config.get("pretrain", {}).get("params", {})
    base = parse_variant(wildcards.upstream)[0]
    own = params.get(base, {})
    matched = params.get(own.get("match", "dpadapter"), {}) if base == "control" else {}
    return fingerprint("data", "public", "model", "seed", "robustness") + json.dumps(
        [own, matched], sort_keys=True
    )


def pretrain_inputs(wildcards):
    """Methods that build on the warm-up get its checkpoint; scratch gets nothing."""
    if _UPSTREAM_REGISTRY[parse_variant(wildcards.upstream)[0]].needs_warmup:
        return {"warmup": f"{RESULTS}/warmup/model.pt"}
    return {}


rule pretrain:
    """One registered upstream method (scratch, standard, ...) -> a pre-trained checkpoint."""
    input:
        unpack(pretrain_inputs),
    output:
        model=f"{RESULTS}/pretrain/{{upstream}}/model.pt",
        metrics=f"{RESULTS}/pretrain/{{upstream}}/metrics.json",
    params:
        fp=pretrain_fingerprint,
        warmup=lambda wc, input: f"--warmup {input.warmup}" if "warmup" in input.keys() else "",
    log:
        "logs/pretrain/{upstream}.log",
    benchmark:
        "benchmarks/pretrain/{upstream}.tsv"
    threads: workflow.cores
    resources:
        gpu=1,
        mem_mb=8000,
        runtime=720,
    shell:
        "DPADAPTER_THREADS={threads} {PYTHON} -m dpadapter --config {CONFIG_FILE} "
        "pretrain --method {wildcards.upstream} {params.warmup} "
        "--out {RESULTS}/pretrain/{wildcards.upstream} > {log} 2>&1"
