"""Private hyperparameter search with the linear scaling rule (Panda et al., 2024).

Two regimes (`hpo.regime`) share this core: `linear-probe` (package `probe`; the paper's: a
linear head on frozen features; the default) and `network` (the whole network fine-tuned with a
registered DP algorithm). The core is what both must agree on: `space` (r = lr * T, its grid,
decompositions, the r(eps) fit), `selection` (private release of each sweep's winner),
`accounting` (PLD composition of everything released), `seeds` (the seed streams of a
replicate), `cli` (the stages' entry points) and `jobs` below (what the workflow schedules).

Layer 5 (an experiment built on the loops): it may import `train` and everything below, and
the other experiments of its layer, never a stage or an entry point.
"""

from dpadapter.settings.grid import grid

__all__ = ["jobs", "probe_pairs"]


def jobs(cfg) -> list[tuple[str, str, str, int]]:
    """Every (upstream, task, algorithm, seed) HPO; empty upstreams/tasks mean all."""
    h = cfg.hpo
    return grid(*_axes(cfg), h.algorithms, [int(s) for s in h.seeds])


def _axes(cfg) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The upstreams and tasks the HPO runs on: `hpo.upstreams`/`hpo.tasks`, empty = all."""
    h = cfg.hpo
    return h.upstreams or cfg.upstreams, h.tasks or tuple(cfg.tasks)


def probe_pairs(cfg) -> list[tuple[str, str]]:
    """Every (upstream, task) of the linear-probe regime (one feature file, oracle, summary)."""
    return grid(*_axes(cfg))
