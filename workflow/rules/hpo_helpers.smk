# Paths and helpers of the HPO rules (hpo.smk); kept apart because Snakemake's linter wants
# rules and functions in separate files.
from dpadapter.hpo import jobs as _hpo_jobs
from dpadapter.hpo import probe_pairs as _probe_pairs
from dpadapter.settings.grid import grid as _grid

HPO_JOBS = _hpo_jobs(CFG)
HPO_GRID_DIR = f"{RESULTS}/hpo/{{upstream}}/{{task}}/{{algo}}"
HPO_DIR = f"{HPO_GRID_DIR}/seed{{seed}}"
HPO_GRID_PLAN = f"{HPO_GRID_DIR}/seed{CFG.hpo.seeds[0]}/plan.json"
HPO_LOG = f"{RESULTS}/logs/hpo/{{upstream}}/{{task}}/{{algo}}/seed{{seed}}"
HPO_BENCH = f"{RESULTS}/benchmarks/hpo/{{upstream}}/{{task}}/{{algo}}/seed{{seed}}"
HPO_SWEEPS = range(len(CFG.hpo.sweep_epsilons))
HPO_TRIALS = range(CFG.hpo.trials_per_sweep)
HPO_POINTS = range(CFG.hpo.grid_size)


def _hpo_expand(pattern):
    return list(
        dict.fromkeys(
            pattern.format(upstream=u, task=t, algo=a, seed=s) for u, t, a, s in HPO_JOBS
        )
    )


def _trial_paths(wc, sweeps=None):
    d = HPO_DIR.format(upstream=wc.upstream, task=wc.task, algo=wc.algo, seed=wc.seed)
    ks = HPO_SWEEPS if sweeps is None else sweeps
    return [f"{d}/trials/s{k}/t{i}/metrics.json" for k in ks for i in HPO_TRIALS]


# The linear-probe regime (hpo_probe.smk): one feature file, oracle and summary per
# (upstream, task); one replicate per HPO seed.
def _probe_expand(pattern, seeds=False):
    pairs = _probe_pairs(CFG)
    return list(
        dict.fromkeys(
            pattern.format(upstream=u, task=t, seed=s)
            for (u, t), s in _grid(pairs, CFG.hpo.seeds if seeds else [None])
        )
    )


def _hpo_target(wc):
    out = [f"{RESULTS}/summary/hpo.csv", f"{RESULTS}/summary/hpo.md"]
    return out + ([f"{RESULTS}/summary/hpo.json"] if CFG.hpo.regime == "linear-probe" else [])
