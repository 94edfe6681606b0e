# The paper's gamma sweeps: each method of `sweeps.methods` pre-trained at every gamma (as an
# upstream variant `method+gamma=g`, through the ordinary pretrain/finetune rules), DPAdapter's
# variants fine-tuned at one epsilon; figures + CSVs under results/figures/.
from dpadapter.settings.grid import grid as _grid
from dpadapter.upstream.variants import format_variant

SWEEP = CFG.sweeps
SWEEP_UPSTREAMS = [format_variant(m, gamma=g) for m, g in _grid(SWEEP.methods, SWEEP.gammas)]
SWEEP_FINETUNE = [
    f"{RESULTS}/finetune/{format_variant('dpadapter', gamma=g)}/{t}/{SWEEP.algorithm}/"
    f"eps{SWEEP.epsilon:g}/seed{s}/metrics.json"
    for g, t, s in _grid(SWEEP.gammas, SWEEP.tasks or TASKS, SWEEP.seeds)
] if "dpadapter" in SWEEP.methods else []


rule sweeps:
    """Fig. 5 (gamma sweep) and Fig. 6 (SAM vs DPAdapter, + standard) analogues."""
    input:
        section_guard("sweeps"),
        pretrain=expand(f"{RESULTS}/pretrain/{{u}}/metrics.json", u=SWEEP_UPSTREAMS + ["standard"]),
        finetune=SWEEP_FINETUNE,
    output:
        report_figure(f"{RESULTS}/figures/gamma_sweep.png", "gamma_sweep", "sweeps"),
        f"{RESULTS}/figures/gamma_sweep.csv",
        report_figure(f"{RESULTS}/figures/sam_vs_dpadapter.png", "sam_vs_dpadapter", "sweeps"),
        f"{RESULTS}/figures/sam_vs_dpadapter.csv",
    params:
        **JOB_PARAMS,
        out=out_dir,
        about=report_about("sweeps"),
    log:
        f"{RESULTS}/logs/sweeps.log",
    conda:
        PIPELINE_ENV
    resources:
        **cpu_job(),
    shell:
        "{params.python} -m dpadapter --config {params.config} sweep-figures "
        "--pretrain {input.pretrain} --finetune {input.finetune} --out {params.out} > {log} 2>&1"
