"""Choose the default grid's fine-tuning recipe on a public proxy task: no privacy cost, no test.

Why a proxy and not the private HPO (`dpadapter.hpo.network`): the default grid compares
upstream methods, and a recipe tuned on the private tasks would have to charge its trials to
every cell's epsilon (and would be tuned on one upstream's luck). Here every trial trains on
public data that pre-training never saw (`tasks.fmnist-proxy`: the public set's classes, held
out of `public.n_train`, shaped as the private tasks: the same number of training examples, so
the same sampling rates and noise for a given batch size), so choosing costs no privacy and
never reads a private task's test split. The candidates are scored on the proxy's validation
split; its test split (also public) only reports the chosen recipe.

The search space (a YAML file, `configs/recipe/search.yaml`) lists batch size, epochs, learning
rate, momentum and clipping norm; every candidate runs on each listed upstream, epsilon and seed.
The score of a candidate is the mean over (upstream, epsilon) of (mean over seeds - std over
seeds) on the validation split: the default table needs cells whose seeds agree as much as it
needs high accuracy. The upstreams are the two ends of the grid (`scratch`, `standard`), neither
of them the method under study, so the recipe cannot favour DPAdapter. Ties go to the cheaper
candidate (fewer epochs), then to the earlier one in the file.

Each algorithm is tuned the same way (`algorithm` in the search file; one file per algorithm,
`configs/recipe/search-<algo>.yaml` -> `chosen-<algo>.yaml`): the shared recipe's keys and the
algorithm's own knobs (`algo_space`, keys of its `finetune.algo_params` entry, e.g. AdpClip's
target quantile and clip learning rate, DP-SAT's rho) are searched together, with the same
upstreams, epsilons, seeds and score; the chosen values go to `finetune.recipes.<algo>` and
`finetune.algo_params.<algo>` of config.yaml (configs/table1.yaml, which shares its results
folder, inherits them).

Every run is deterministic (explicit seeds, one CPU thread per worker, the pipeline's own DP
fine-tuning code: `train.dp_fit` with the configured accountant and Poisson sampling), so a
re-run writes the same file. The output (`configs/recipe/chosen.yaml`) holds the chosen values,
which `config.yaml`'s `finetune` section must hold (tests/hpo/test_recipe.py checks it), and the
whole table of candidates.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import itertools
import json
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from dpadapter.ground import atomic
from dpadapter.settings import RECIPE_KEYS as KEYS
from dpadapter.settings import Config
from dpadapter.settings import load as load_config

DPSGD = "dpsgd"


@dataclass(frozen=True)
class Search:
    proxy_task: str
    upstreams: tuple[str, ...]
    epsilons: tuple[float, ...]
    seeds: tuple[int, ...]
    space: dict[str, tuple[Any, ...]]
    algorithm: str = DPSGD
    # the algorithm's own knobs (keys of its algo_params), searched with the recipe
    algo_space: dict[str, tuple[Any, ...]] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        missing = [k for k in KEYS if not self.space.get(k)]
        if missing:
            raise ValueError(f"recipe search: space lacks {missing} (needs every one of {KEYS})")
        unknown = sorted(set(self.space) - set(KEYS))
        if unknown:
            raise ValueError(f"recipe search: unknown space keys {unknown}; known: {KEYS}")
        if not (self.upstreams and self.epsilons and self.seeds):
            raise ValueError("recipe search: upstreams, epsilons and seeds must not be empty")
        from dpadapter.algorithms import ALGORITHMS

        if self.algorithm not in ALGORITHMS:
            raise ValueError(
                f"recipe search: unknown algorithm {self.algorithm!r}; known: {sorted(ALGORITHMS)}"
            )
        own = set(ALGORITHMS[self.algorithm].default_params())
        bad = sorted(k for k, v in self.algo_space.items() if k not in own or not v)
        if bad:
            raise ValueError(
                f"recipe search: algo_space keys {bad} are not {self.algorithm}'s params "
                f"(or list no value); its params: {sorted(own)}"
            )

    @classmethod
    def load(cls, path: Path) -> Search:
        raw = yaml.safe_load(path.read_text())
        return cls(
            proxy_task=raw["proxy_task"],
            upstreams=tuple(raw["upstreams"]),
            epsilons=tuple(float(e) for e in raw["epsilons"]),
            seeds=tuple(int(s) for s in raw["seeds"]),
            space={k: tuple(v) for k, v in raw["space"].items()},
            algorithm=raw.get("algorithm", DPSGD),
            algo_space={k: tuple(v) for k, v in (raw.get("algo_space") or {}).items()},
        )

    def candidates(self) -> list[dict[str, Any]]:
        """The shared recipes (the recipe keys only: DP-SGD's search file is read as before)."""
        return [
            dict(zip(KEYS, c, strict=True)) for c in itertools.product(*map(self.space.get, KEYS))
        ]

    def trials(self) -> list[tuple[dict[str, Any], dict[str, Any]]]:
        """Every (recipe, algorithm params) pair searched, recipes outermost."""
        names = sorted(self.algo_space)
        params = [dict(zip(names, c, strict=True)) for c in itertools.product(
            *(self.algo_space[n] for n in names))]  # fmt: skip
        return [(r, p) for r in self.candidates() for p in params]


def with_recipe(cfg: Config, recipe: dict[str, Any], check: bool = True) -> Config:
    """`cfg` fine-tuning with `recipe`; `check: False` skips the per-sample self-test (it
    forks the RNG and changes no result, only the time: the search runs hundreds of jobs)."""
    ft = dataclasses.replace(cfg.finetune, **recipe, per_sample_check=check)
    return dataclasses.replace(cfg, finetune=ft)


def checkpoint_path(cfg: Config, upstream: str) -> Path:
    return Path(cfg.results_dir) / "pretrain" / upstream / "model.pt"


@dataclass(frozen=True)
class Run:
    """One run of the search: an upstream fine-tuned with a recipe (and the algorithm's params
    on top of the config's) at one epsilon and seed."""

    upstream: str
    recipe: dict[str, Any]
    eps: float
    seed: int
    algorithm: str = DPSGD
    params: dict[str, Any] | None = None

    def key(self, ckpt_digest: str) -> str:
        """The cache key; DP-SGD's without params as it always was (its cache stays valid)."""
        parts: list[Any] = [ckpt_digest, self.recipe, self.upstream, self.eps, self.seed]
        if self.algorithm != DPSGD or self.params:
            parts += [self.algorithm, self.params or {}]
        return json.dumps(parts, sort_keys=True)


def proxy_run(cfg: Config, task: str, run: Run, on_epoch=None) -> dict:
    """One DP fine-tuning of the proxy task (`run`); its accuracies. `on_epoch(epoch, stats)`:
    each epoch's training stats (a probe of the algorithm's course, tools/table1_probe.py)."""
    from dpadapter.data import public_train
    from dpadapter.models import replace_head
    from dpadapter.train.checkpoint import load_model
    from dpadapter.train.dp_fit import FitSettings, dp_fit
    from dpadapter.train.dp_spec import run_spec
    from dpadapter.train.job import seed_everything
    from dpadapter.train.loops import evaluate

    c = with_recipe(cfg, run.recipe, check=False)
    algo, seed = run.algorithm, run.seed
    if run.params:
        own = {**c.finetune.algo_params.get(algo, {}), **run.params}
        ft = dataclasses.replace(c.finetune, algo_params={**c.finetune.algo_params, algo: own})
        c = dataclasses.replace(c, finetune=ft)
    seed_everything(seed)
    data = _splits(c, task)
    model, _ = load_model(checkpoint_path(c, run.upstream))
    replace_head(model, data.num_classes, seed)
    spec = run_spec(c, algo, run.eps, len(data.train), run.upstream, task)
    _, ledger = dp_fit(
        model,
        data.train,
        algo,
        spec,
        FitSettings.from_config(c),
        seed,
        public=public_train(c),  # GEP's anchor gradients: the public set, as in the grid
        on_epoch=on_epoch,
    )
    return {
        "val_accuracy": evaluate(model, data.val),
        "test_accuracy": evaluate(model, data.test),
        "epsilon": ledger.epsilon(),
        "steps": ledger.steps,
    }


_SPLITS: dict[str, Any] = {}


def _splits(cfg: Config, task: str):
    """The proxy's tensors, built once per worker: keyed by what the split depends on (the
    data, public and task sections), so another config never gets a stale split."""
    key = repr((task, cfg.data, cfg.public, cfg.tasks))
    if key not in _SPLITS:
        from dpadapter.data import build_splits

        _SPLITS[key] = build_splits(cfg, [task])[1][task]
    return _SPLITS[key]


def _worker_init() -> None:
    import torch

    torch.set_num_threads(1)  # the same float results whatever the number of workers


def _job(args: tuple) -> tuple[str, dict]:
    cfg_path, task, run, key = args
    return key, proxy_run(load_config(cfg_path), task, run)


def score(rows: list[dict]) -> dict:
    """mean over (upstream, eps) cells of (mean - std over seeds) of the validation accuracy."""
    cells: dict[tuple, list[float]] = {}
    for r in rows:
        cells.setdefault((r["upstream"], r["epsilon_target"]), []).append(100 * r["val_accuracy"])
    per_cell = {
        f"{u}/eps{e:g}": (statistics.fmean(v), statistics.stdev(v) if len(v) > 1 else 0.0)
        for (u, e), v in sorted(cells.items())
    }
    return {
        "score": statistics.fmean(m - s for m, s in per_cell.values()),
        "cells": {k: {"mean": round(m, 2), "std": round(s, 2)} for k, (m, s) in per_cell.items()},
    }


def search(cfg_path: Path, search: Search, cache_path: Path, workers: int) -> dict:
    cfg = load_config(cfg_path)
    if search.proxy_task not in cfg.tasks or cfg.tasks[search.proxy_task].grids:
        raise ValueError(
            f"recipe search: proxy_task {search.proxy_task!r} must be a task of {cfg_path} with "
            "grids: false (public data kept out of pre-training and out of the grids)"
        )
    digests = {u: _digest(checkpoint_path(cfg, u)) for u in search.upstreams}
    cache = _read_cache(cache_path)
    jobs, plan = [], []
    algo = search.algorithm
    for recipe, params in search.trials():
        for u, e, s in itertools.product(search.upstreams, search.epsilons, search.seeds):
            key = Run(u, recipe, e, s, algo, params).key(digests[u])
            plan.append(((recipe, params), u, e, s, key))
            if key not in cache:
                run = Run(u, recipe, e, s, algo, params)
                jobs.append((str(cfg_path), search.proxy_task, run, key))
    print(f"recipe search: {len(plan)} runs, {len(plan) - len(jobs)} cached", file=sys.stderr)
    cache_path.parent.mkdir(parents=True, exist_ok=True)
    with ProcessPoolExecutor(workers, initializer=_worker_init) as pool, cache_path.open("a") as f:
        for i, (key, result) in enumerate(pool.map(_job, jobs), 1):
            cache[key] = result
            f.write(json.dumps({"key": key, "result": result}) + "\n")
            f.flush()
            if i % 10 == 0 or i == len(jobs):
                print(f"recipe search: {i}/{len(jobs)} runs done", file=sys.stderr)
    table = []
    for trial in search.trials():
        rows = [
            {"upstream": u, "epsilon_target": e, "seed": s, **cache[k]}
            for t, u, e, s, k in plan
            if t == trial
        ]
        table.append({"recipe": trial[0], "algo_params": trial[1], **score(rows), "rows": rows})
    best = max(
        range(len(table)),
        key=lambda i: (round(table[i]["score"], 6), -table[i]["recipe"]["epochs"], -i),
    )
    chosen = table[best]
    test = [r["test_accuracy"] for r in chosen["rows"]]
    own = {"algorithm": algo, "chosen_algo_params": chosen["algo_params"]} if algo != DPSGD else {}
    return {
        **own,
        "chosen": chosen["recipe"],
        "chosen_score": round(chosen["score"], 3),
        "chosen_proxy_test_accuracy": round(100 * statistics.fmean(test), 2),
        "proxy_task": search.proxy_task,
        "upstreams": list(search.upstreams),
        "epsilons": list(search.epsilons),
        "seeds": list(search.seeds),
        "checkpoints": digests,
        "candidates": [
            {
                "recipe": t["recipe"],
                **({"algo_params": t["algo_params"]} if algo != DPSGD else {}),
                "score": round(t["score"], 3),
                "cells": t["cells"],
            }
            for t in table
        ],
    }


def _digest(path: Path) -> str:
    if not path.is_file():
        raise FileNotFoundError(
            f"recipe search: {path} is missing; make the upstream checkpoints first "
            f"(snakemake {path} --configfile CONFIG)"
        )
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def _read_cache(path: Path) -> dict[str, dict]:
    if not path.is_file():
        return {}
    out = {}
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:  # a line cut by an interrupted search: that run is done again
            continue
        out[rec["key"]] = rec["result"]
    return out


HEADER = (
    "# Written by `python -m dpadapter.hpo.recipe` (dpadapter/hpo/recipe.py) from the search in\n"
    "# configs/recipe/search.yaml on the public proxy task; config.yaml's finetune section holds\n"
    "# `chosen` (tests/hpo/test_recipe.py). Do not edit by hand: re-run the script.\n"
)
ALGO_HEADER = (
    "# Written by `python -m dpadapter.hpo.recipe --search {search}` (dpadapter/hpo/recipe.py) on\n"
    "# the public proxy task, the procedure of DP-SGD's recipe (configs/recipe/search.yaml) for\n"
    "# {algo}; config.yaml (and so configs/table1.yaml) holds `chosen` in\n"
    "# finetune.recipes.{algo} and `chosen_algo_params` in finetune.algo_params.{algo}\n"
    "# (tests/hpo/test_recipe.py).\n"
    "# Do not edit by hand: re-run the script.\n"
)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dpadapter.hpo.recipe", description=__doc__)
    p.add_argument("--config", type=Path, default=Path("config.yaml"))
    p.add_argument("--search", type=Path, default=Path("configs/recipe/search.yaml"))
    p.add_argument("--out", type=Path, default=Path("configs/recipe/chosen.yaml"))
    p.add_argument("--cache", type=Path, default=None, help="runs done (default: results_dir)")
    p.add_argument("--workers", type=int, default=2)
    a = p.parse_args(argv)
    cfg = load_config(a.config)
    cache = a.cache or Path(cfg.results_dir) / "recipe" / "runs.jsonl"
    spec = Search.load(a.search)
    out = search(a.config, spec, cache, a.workers)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    head = (
        HEADER
        if spec.algorithm == DPSGD
        else ALGO_HEADER.format(search=a.search, algo=spec.algorithm)
    )
    atomic.write_text(a.out, head + yaml.safe_dump(out, sort_keys=False, width=100))
    own = f" {out['chosen_algo_params']}" if "chosen_algo_params" in out else ""
    print(f"chosen: {out['chosen']}{own} (score {out['chosen_score']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
