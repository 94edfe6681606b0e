"""The main grid's stages' own checks of a config: fine-tuning (its names, its model, and the
privacy budget its grid can reach) and the report's published table (`reference`).

Names are read from `dpadapter.registries.catalog` without torch; dataset sizes from the registry's
declared counts (`dpadapter.data.sizes`). Each problem is a `key: text` line;
`dpadapter.validation.compose` composes them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Iterator
from contextvars import ContextVar

from dpadapter.data.sizes import task_sizes
from dpadapter.privacy import max_reachable_epsilon
from dpadapter.privacy.calibration import SIGMA_MIN
from dpadapter.registries import catalog
from dpadapter.settings import Config
from dpadapter.settings.errors import NOT_METHOD, missing


def algorithm_problems(cfg: Config) -> list[str]:
    """`finetune.algorithms` against the registry; with `finetune.processes` > 1, every
    algorithm of the fine-tuning grids must run across processes."""
    algos = catalog.algorithms()
    out = [
        f"finetune.algorithms: unknown algorithm {name!r}; known: {sorted(algos)}"
        for name in cfg.finetune.algorithms
        if name not in algos
    ]
    out += [
        f"finetune.recipes.{name}: unknown algorithm {name!r}; known: {sorted(algos)}"
        for name in cfg.finetune.recipes
        if name not in algos
    ]
    used = dict.fromkeys(job[2] for job in cfg.finetune_grid())
    if cfg.finetune.compile != "off":
        out += [
            f"finetune.compile: {name!r} reads per-example gradients itself and runs Opacus' "
            "hooks, which are not compiled; set compile: off or leave it out of the grid"
            for name in used
            if name in algos and algos[name].needs_per_sample_gradients
        ]
    if cfg.finetune.processes > 1:
        for name in used:
            why = algos[name].distributed_refusal if name in algos else None
            if why:
                out.append(
                    f"finetune.processes: {cfg.finetune.processes} processes cannot run "
                    f"{name!r}: {why}; run it with processes: 1"
                )
    return out


def grid_problems(cfg: Config) -> list[str]:
    """The fine-tuning grids' names against the config and the registry, what `finetune`
    tells alone, the model's name and the privacy section's delta."""
    problems, ft, algos, models = [], cfg.finetune, catalog.algorithms(), catalog.models()
    problems += missing("finetune.upstreams", ft.upstreams, cfg.upstreams, NOT_METHOD)
    for i, g in enumerate(ft.extra_grids):
        where = f"finetune.extra_grids.{i}"
        problems += missing(f"{where}.algorithms", g.algorithms, algos, "unknown algorithm {}")
        problems += missing(f"{where}.upstreams", g.upstreams, cfg.upstreams, NOT_METHOD)
        problems += missing(f"{where}.tasks", g.tasks, cfg.tasks, "unknown task {}")
    problems += ft.problems()
    for i, entry in enumerate(ft.algo_params_for):
        where = f"finetune.algo_params_for.{i}"
        problems += missing(f"{where}.upstreams", entry.upstreams, cfg.upstreams, NOT_METHOD)
        problems += missing(f"{where}.tasks", entry.tasks, cfg.tasks, "unknown task {}")
    if not cfg.model.name.startswith("timm:") and cfg.model.name not in models:
        problems.append(
            f"model.name: unknown model {cfg.model.name!r}; "
            f"known: {sorted(models)} or 'timm:<name>'"
        )
    if not 0 < cfg.privacy.delta < 1:
        problems.append("privacy.delta: must be in (0, 1)")
    return problems


# The (task, epsilon) cells whose reach is checked (None: all). The workflow checks every cell
# before any job; a job validates its config again but trains at most one cell of it (a
# fine-tuning job its own, the other stages none), and each distinct (q, steps) costs the RDP
# bound about 0.25 s of CPU (Opacus' fractional-order series at sigma = SIGMA_MIN): half of a
# tiny fine-tuning job's time in the fork server's children, paid by every job of the grid.
_ONLY: ContextVar[frozenset[tuple[str, float]] | None] = ContextVar(
    "dpadapter_checked_cells", default=None
)


@contextlib.contextmanager
def only_cells(cells: Collection[tuple[str, float]] | None) -> Iterator[None]:
    """Within: `privacy_problems` checks the reach of these (task, epsilon) cells only."""
    token = _ONLY.set(None if cells is None else frozenset((t, float(e)) for t, e in cells))
    try:
        yield
    finally:
        _ONLY.reset(token)


def privacy_problems(cfg: Config) -> list[str]:
    """Delta against the smallest task, each grid epsilon against what the calibration reaches
    (the cells of `only_cells`: a job's own)."""
    out = []
    delta = cfg.privacy.delta
    if not 0 < delta < 1:
        return out
    sizes = {n: s for n, s in task_sizes(cfg).items() if s > 0}
    if sizes:
        task, n = min(sizes.items(), key=lambda kv: kv[1])
        if delta >= 1 / n:
            out.append(
                f"privacy.delta: {delta:g} is not below 1/n = {1 / n:.3g} for task {task!r} "
                f"({n} training examples): a delta of 1/n allows releasing an example outright; "
                f"use delta << 1/n (e.g. 1.0e-5)"
            )
            return out
    ft = cfg.finetune
    grids: dict[str, dict[float, str]] = {}
    for _, t, _, e, *_ in cfg.finetune_grid():
        grids.setdefault(t, {}).setdefault(float(e), "finetune.epsilons")
    if "dpadapter" in cfg.sweeps.methods:  # the sweeps fine-tune DPAdapter's variants only
        for t in cfg.sweeps.tasks or tuple(cfg.tasks):
            grids.setdefault(t, {}).setdefault(float(cfg.sweeps.epsilon), "sweeps.epsilon")
    only = _ONLY.get()
    for task, epsilons in grids.items():
        n = sizes.get(task)
        if n is None:
            continue
        if ft.batch_size > n:
            out.append(
                f"finetune.batch_size: {ft.batch_size} exceeds task {task!r}'s {n} training "
                "examples"
            )
            continue
        if only is not None:
            epsilons = {e: at for e, at in epsilons.items() if (task, e) in only}
            if not epsilons:
                continue
        q = ft.batch_size / n
        steps = ft.epochs * int(1 / q)
        top = max_reachable_epsilon(delta, q, steps)
        for eps in sorted(e for e in epsilons if e > top):
            out.append(
                f"{epsilons[eps]}: epsilon {eps:g} on task {task!r} is out of reach of the "
                f"sigma calibration: even sigma = {SIGMA_MIN} (negligible noise) gives "
                f"epsilon <= {top:.3g} for {ft.epochs} epochs at sample rate {q:.3g}; use an "
                "epsilon below that"
            )
    return out


def reference_problems(cfg: Config) -> list[str]:
    """The published table must point at runs this config makes, or its columns stay empty."""
    ref, out, algos = cfg.reference, [], catalog.algorithms()
    if ref is None:
        return out
    if ref.upstream not in cfg.upstreams:
        out.append(f"reference.upstream: {ref.upstream!r} is not in pretrain.methods")
    if ref.task not in cfg.tasks:
        out.append(f"reference.task: unknown task {ref.task!r}; known: {sorted(cfg.tasks)}")
    cells = {c.algorithm for c in ref.cells}
    for i, c in enumerate(ref.cells):
        if c.algorithm not in algos:
            out.append(f"reference.cells.{i}.algorithm: unknown algorithm {c.algorithm!r}")
        if c.upstream is not None and c.upstream not in cfg.upstreams:
            out.append(f"reference.cells.{i}.upstream: {c.upstream!r} is not in pretrain.methods")
        if c.task is not None and c.task not in cfg.tasks:
            out.append(f"reference.cells.{i}.task: unknown task {c.task!r}")
    for key in ("baseline", "improved"):
        if getattr(ref, key) not in cells:
            out.append(f"reference.{key}: {getattr(ref, key)!r} has no cell in reference.cells")
    strategies = {job[5] for job in cfg.finetune_grid()}
    if len(strategies) > 1:  # a published cell is one algorithm's, tuned one way
        out.append(
            f"finetune.strategies: the published table (reference) is compared with one tuning "
            f"strategy's runs, and the grid has {sorted(strategies)}; keep one, or compare the "
            "strategies in a config without reference"
        )
    return out
