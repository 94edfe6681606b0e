"""The rerun trigger of each workflow stage: a fingerprint of the config its jobs read.

Snakemake reruns a job when one of its params changes, so every training rule passes
`fp=stage_fingerprint(config, stage, wildcards)`. What a stage reads is declared once, in
`STAGES`: whole top-level sections; sections without the keys that only say which jobs exist
(an exclusion list, so a key added to a section later is covered without anyone having to
remember it here); and the entries its wildcards pick (its task, its algorithm's params, its
upstream method's params). Adding a seed, an epsilon or an algorithm therefore reruns nothing
that is already built, while any setting a finished job was trained with does.

The value is laid out as the hand-written fingerprints it replaced were (a hash of the whole
sections, then the JSON text of each further part), so results built before keep their value
and are not rerun (tests/workflow/test_fingerprint.py checks it against those formulas). Only
the stdlib: the workflow computes these while parsing, before any training code is imported.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

# What a part reads: the raw config (Snakemake's `config`) and the job's wildcards. Snakemake's
# Wildcards object is not a Mapping but answers `wc["name"]` as a dict does.
Part = Callable[[Mapping[str, Any], Any], Any]

# Keys of `finetune` that only set which fine-tuning jobs exist. `algo_params` is here as a whole
# because each job reads its own algorithm's entry (`algo_params` below).
FINETUNE_GRID = (
    "algorithms",
    "epsilons",
    "seeds",
    "upstreams",
    "extra_grids",
    "strategies",
    "algo_params",
    "algo_params_for",
    "recipes",
)
# The fine-tune jobs' fingerprint has covered `finetune.upstreams` since it was written; leaving
# it out now would rerun every finished fine-tuning job after an upgrade.
_FINETUNE_JOB_GRID = tuple(k for k in FINETUNE_GRID if k != "upstreams")
# Keys of `audit` that only set which audit jobs exist.
AUDIT_GRID = ("algorithms", "epsilons", "federated")
# Keys of `federated` that only set which federated jobs exist; each mechanism's own `epsilons`
# list is one too.
FEDERATED_GRID = (
    "upstreams",
    "strategies",
    "mechanisms",
    "seeds",
    "rounds_sweep",
    "sweep_epsilons",
    "sweep_seeds",
)
FEDERATED_MECHANISM_GRID = ("epsilons",)
# `control`'s `match` when its params leave it out (dpadapter.upstream.control).
_CONTROL_DEFAULT_MATCH = "dpadapter"


def without(section: str, grid: Collection[str], nested: Collection[str] = ()) -> Part:
    """A section minus its grid keys; `nested` are dropped from each dict-valued entry too."""

    def trim(value: Any) -> Any:
        if nested and isinstance(value, dict):
            return {k: v for k, v in value.items() if k not in nested}
        return value

    def part(config: Mapping[str, Any], wildcards: Any) -> dict[str, Any]:
        return {k: trim(v) for k, v in config.get(section, {}).items() if k not in grid}

    part.__name__ = f"without({section!r})"
    return part


def task(config: Mapping[str, Any], wildcards: Any) -> Any:
    """The `{task}` wildcard's entry of `tasks` (a KeyError names an unknown task)."""
    return config["tasks"][wildcards["task"]]


def algo_params(config: Mapping[str, Any], wildcards: Any) -> Any:
    """The `{algo}` wildcard's `finetune.algo_params` entry ({} for none, as for a federated-*
    audit job)."""
    ft = config.get("finetune", {})
    # a job folder `algo+strategy` (dpadapter.settings.split_folder) reads its algorithm's params
    algo = str(wildcards["algo"]).partition("+")[0]
    base = ft.get("algo_params", {}).get(algo, {})
    # `algo_params_for` entries that apply to this job, in order (its params are base + these);
    # without any, the value is the entry alone, as it always was.
    wc = {k: _wildcard(wildcards, k) for k in ("upstream", "task")}
    extra = [
        e["algo_params"][algo]
        for e in ft.get("algo_params_for", ())
        if algo in e.get("algo_params", {})
        and all(wc[k] is None or wc[k] in e.get(k + "s", (wc[k],)) for k in wc)
    ]
    return {"base": base, "for": extra} if extra else base


def _wildcard(wildcards: Any, name: str) -> Any:
    try:
        return wildcards[name]
    except (KeyError, AttributeError, IndexError):
        return None


def _upstream_method(wildcards: Any) -> str:
    # The method of a variant name `method+param=value...` (dpadapter.upstream.variants); the
    # wildcard's constraint has checked its form already.
    return str(wildcards["upstream"]).partition("+")[0]


def upstream_params(config: Mapping[str, Any], wildcards: Any) -> Any:
    """The `{upstream}` method's `pretrain.params` entry, or its `pretrain.external` entry for
    a label (config params; a variant's own overrides are in its name, hence in the output
    path). An external file's content is a rule input, so a changed file reruns too."""
    pre, method = config.get("pretrain", {}), _upstream_method(wildcards)
    external = pre.get("external", {})
    if method in external:
        return external[method]
    return pre.get("params", {}).get(method, {})


def matched_params(config: Mapping[str, Any], wildcards: Any) -> Any:
    """For `control`, the params of the method it continues the schedule of; {} otherwise."""
    if _upstream_method(wildcards) != "control":
        return {}
    params = config.get("pretrain", {}).get("params", {})
    return params.get(params.get("control", {}).get("match", _CONTROL_DEFAULT_MATCH), {})


@dataclass(frozen=True)
class Stage:
    """What one stage's jobs read.

    `sections` are hashed whole. Each entry of `parts` is one JSON text after that hash, a
    tuple of parts as a JSON list: the grouping only reproduces the earlier hand-written
    values. `plus` names a stage whose fingerprint is appended (a federated job reads its
    upstream checkpoint through `ancient()`, so its rerun trigger carries the pretrain one).
    """

    sections: tuple[str, ...]
    parts: tuple[Part | tuple[Part, ...], ...] = ()
    plus: str | None = None

    def reads(self) -> set[str]:
        """Top-level sections this stage's fingerprint covers, whole or in part."""
        names = set(self.sections)
        for chunk in self.parts:
            for p in chunk if isinstance(chunk, tuple) else (chunk,):
                names |= _PART_SECTIONS[p]
        if self.plus:
            names |= STAGES[self.plus].reads()
        return names


def with_recipe(part: Part) -> Part:
    """`part` (the finetune section a job reads) with the job's algorithm's `finetune.recipes`
    entry in place of the shared recipe: what the job trains with. Without an entry the value
    is the section's, as it always was, so jobs built before recipes existed are not rerun."""

    def job(config: Mapping[str, Any], wildcards: Any) -> dict[str, Any]:
        out = part(config, wildcards)
        algo = str(_wildcard(wildcards, "algo") or "").partition("+")[0]
        own = config.get("finetune", {}).get("recipes", {}).get(algo)
        return {**out, **own} if own else out

    job.__name__ = f"with_recipe({part.__name__})"
    return job


_FINETUNE_JOB = with_recipe(without("finetune", _FINETUNE_JOB_GRID))
# the audit and federated stages train with the shared recipe (they read no `recipes`)
_FINETUNE_SHARED = without("finetune", FINETUNE_GRID)
_FINETUNE = with_recipe(_FINETUNE_SHARED)
# Version 2 (results folders begun by this code, dpadapter.workflow.identity.fingerprint_version): a
# fine-tuning job's trigger leaves out `finetune.upstreams` too, so adding an upstream runs only
# the new jobs. Version 1 folders keep the list in it: their finished jobs were built with it,
# and Snakemake would rerun every one of them if the value changed. So a version 1 folder's
# triggers read the list it was built with (`pins`, dpadapter.workflow.identity.fingerprint_pins),
# not the config's: its finished jobs are carried over, and a grown list adds jobs, as in
# version 2.
# Version 3 adds the content of the data each job reads (`data_part`) to its trigger. A version
# 1 or 2 folder's finished jobs were built without it, and would all rerun if it appeared in
# their triggers: there, the datasets they were built from are left out of `data`
# (dpadapter.workflow.identity.untriggered_data), and only datasets new to the folder count.
CURRENT_VERSION = 3
DATA_VERSION = 3
# The pinned key of a version 1 folder, as `pins` names it (absent from `pins`: no such key).
PINNED_UPSTREAMS = "finetune.upstreams"
_AUDIT = without("audit", AUDIT_GRID)
_FEDERATED = without("federated", FEDERATED_GRID, nested=FEDERATED_MECHANISM_GRID)

_PART_SECTIONS: dict[Part, set[str]] = {
    _FINETUNE_JOB: {"finetune"},
    _FINETUNE: {"finetune"},
    _FINETUNE_SHARED: {"finetune"},
    _AUDIT: {"audit"},
    _FEDERATED: {"federated"},
    task: {"tasks"},
    algo_params: {"finetune"},
    upstream_params: {"pretrain"},
    matched_params: {"pretrain"},
}

# Rule(s) using each: warmup; pretrain; finetune; audit_run; federated_run; hpo_plan (network
# regime; its other rules read the plan file); hpo_features, hpo_probe_oracle, hpo_probe_seed.
STAGES: dict[str, Stage] = {
    "warmup": Stage(("data", "public", "model", "warmup", "seed", "robustness")),
    "pretrain": Stage(
        ("data", "public", "model", "seed", "robustness"),
        ((upstream_params, matched_params),),
    ),
    "finetune": Stage(
        ("data", "privacy", "robustness", "public"),
        ((_FINETUNE_JOB, algo_params, task),),
    ),
    "audit": Stage(
        ("data", "tasks", "privacy", "public", "federated"),
        ((_FINETUNE_SHARED, _AUDIT), algo_params),
    ),
    # federated clients read finetune.grad_sample_mode and pad_batches (federated/stage.py)
    "federated": Stage(
        ("data", "tasks", "privacy"), ((_FEDERATED, _FINETUNE_SHARED),), plus="pretrain"
    ),
    "hpo": Stage(("data", "finetune", "privacy", "hpo"), (task,)),
    "hpo-probe": Stage(("data", "public", "privacy", "hpo"), (task,)),
}


_FINETUNE_V2 = Stage(STAGES["finetune"].sections, ((_FINETUNE, algo_params, task),))


def _first_task(config: Mapping[str, Any]) -> str | None:
    return next(iter(config.get("tasks") or {}), None)


def _roles_read(config: Mapping[str, Any], stage: str, wildcards: Any) -> list[str]:
    """The roles (public, task names) whose examples a job of `stage` reads, as its entry
    point picks them (dpadapter.audit.canaries, .audit.federated, dpadapter.federated.stage)."""
    if stage in ("warmup", "pretrain"):
        return ["public"]
    if stage in ("finetune", "hpo", "hpo-probe"):
        return [str(wildcards["task"])]
    audit, fed = config.get("audit") or {}, config.get("federated") or {}
    if stage == "audit" and not str(_wildcard(wildcards, "algo") or "").startswith("federated"):
        return [audit.get("task") or _first_task(config)]
    return [fed.get("task") or (audit.get("task") if stage == "audit" else None) or
            _first_task(config)]  # fmt: skip


def data_part(
    config: Mapping[str, Any], stage: str, wildcards: Any, data: Mapping[str, str | None]
) -> str:
    """The content fingerprints (`data`: dataset name -> dpadapter.data.data_fingerprint) of
    the datasets a job reads: its roles' own, and the public set's while the normalisation is
    computed from it (every role is normalised by the public training images' statistics).
    Datasets made by code (None) add nothing, so a config of them alone keeps its value."""
    roles = _roles_read(config, stage, wildcards)
    if (config.get("data") or {}).get("normalization") is None:
        roles = ["public", *roles]
    names = set()
    for role in roles:
        entry = config.get("public") if role == "public" else (config.get("tasks") or {}).get(role)
        if entry and data.get(entry.get("dataset")):
            names.add(entry["dataset"])
    return "data" + _json({n: data[n] for n in sorted(names)}) if names else ""


def _json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def _pinned(config: Mapping[str, Any], pins: Mapping[str, Any]) -> dict[str, Any]:
    """`config` with `finetune.upstreams` as pinned (left out where the pin says it was unset)."""
    ft = {k: v for k, v in config.get("finetune", {}).items() if k != "upstreams"}
    if PINNED_UPSTREAMS in pins:
        ft["upstreams"] = pins[PINNED_UPSTREAMS]
    return {**config, "finetune": ft}


def stage_fingerprint(
    config: Mapping[str, Any],
    stage: str,
    wildcards: Any = None,
    version: int = 1,
    pins: Mapping[str, Any] | None = None,
    data: Mapping[str, str | None] | None = None,
) -> str:
    """The `fp` param of a `stage` job: it changes exactly when config the job reads changes.

    `wildcards`: the job's (Snakemake's Wildcards or a dict); stages whose parts read none
    (warmup) take None. `version`: the results folder's (`CURRENT_VERSION` for a new one);
    `pins`: a version 1 folder's `finetune.upstreams` as its jobs were built (None: the config's).
    `data`: the content fingerprint of each dataset whose content counts (`data_part`).
    """
    spec = STAGES[stage]
    if version >= 2 and stage == "finetune":
        spec = _FINETUNE_V2
    elif stage == "finetune" and pins is not None:
        config = _pinned(config, pins)
    whole = _json({k: config.get(k) for k in spec.sections})
    out = hashlib.sha256(whole.encode()).hexdigest()[:16]
    for chunk in spec.parts:
        if isinstance(chunk, tuple):
            out += _json([p(config, wildcards) for p in chunk])
        else:
            out += _json(chunk(config, wildcards))
    if spec.plus:
        out += stage_fingerprint(config, spec.plus, wildcards)
    if data:
        out += data_part(config, stage, wildcards, data)
    return out
