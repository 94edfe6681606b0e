"""Private hyperparameter search with the linear scaling rule (Panda et al., 2024).

`space` (r = lr * T, its grid, decompositions, the r(eps) fit), `selection` (private release
of each sweep's winner), `accounting` (PLD composition of everything released), `runner`
(training one configuration with any registered DP algorithm), `stages` (the Snakemake
stages), `summary` (hpo.csv / hpo.md).
"""

from dpadapter.hpo.space import ScalingFit, SearchSpace, StepConfig, fit_scaling

__all__ = ["ScalingFit", "SearchSpace", "StepConfig", "fit_scaling", "jobs"]


def jobs(cfg) -> list[tuple[str, str, str, int]]:
    """Every (upstream, task, algorithm, seed) HPO; empty upstreams/tasks mean all."""
    h = cfg.hpo
    return [
        (u, t, a, int(s))
        for u in (h.upstreams or cfg.upstreams)
        for t in (h.tasks or tuple(cfg.tasks))
        for a in h.algorithms
        for s in h.seeds
    ]
