"""Private hyperparameter search with the linear scaling rule (Panda et al., 2024).

Two regimes (`hpo.regime`) share this core: `linear-probe` (package `probe`; the paper's: a
linear head on frozen features; the default) and `network` (the whole network fine-tuned with a
registered DP algorithm). The core is what both must agree on: `space` (r = lr * T, its grid,
decompositions, the r(eps) fit), `selection` (private release of each sweep's winner),
`accounting` (PLD composition of everything released), `seeds` (the seed streams of a
replicate), `cli` (the stages' entry points) and `jobs` below (what the workflow schedules).
"""

__all__ = ["jobs"]


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
