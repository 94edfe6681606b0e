"""The optional sections (`hpo`, `federated`, `sweeps`, `audit`) wait for the targets that run them.

`make run` never runs them, yet every config has them (the code's defaults, or a base's): a user
whose overlay swaps the upstreams for their own checkpoints would otherwise be stopped by
`hpo.upstreams: [standard]` of a base they never meant to run. So the workflow validates the main
grid before anything runs, as always, and keeps each optional section's problems aside
(`validate_scoped`): it says them once, as a warning, and the section's own target refuses to
start with them (`refusal`, from an input function of that target in its rule file). A job
checks the sections its stage reads (`stage_sections`), so a job started some other way still
stops before any work.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from dpadapter.data import resolve_dataset
from dpadapter.settings import Config
from dpadapter.settings.problems import OPTIONAL, error, locate, needed, section_of
from dpadapter.validation.compose import check, check_files_of

# What the audit reads of `federated` when it audits the federated mechanisms (per client, in
# client 0 of the federated setting): not the grid's upstreams, strategies or UT estimates.
AUDIT_READS = ("task", "clients", "dirichlet_alpha", "min_client_size", "split_seed", "rounds")
AUDIT_READS += ("local_steps", "gaussian", "laplace")


def stage_sections(stage: str, raw: dict[str, Any] | None = None) -> tuple[str, ...]:
    """The optional sections (or keys of one) that a job of `stage` (a `python -m dpadapter`
    subcommand) or a target of the workflow (`hpo`, `federated`, `sweeps`, `audit`,
    `validity`) reads.

    `validate` checks every one; validity reads the HPO and federated summaries; the audit reads
    part of `federated` when it audits federated mechanisms (`audit.federated` of the config
    `raw`, on by default); the main grid's stages read none.
    """
    if stage == "validate":
        return tuple(OPTIONAL)
    if stage == "validity":
        return ("hpo", "federated")
    if stage == "audit":
        audit = (raw or {}).get("audit") or {}
        reads = tuple(f"federated.{k}" for k in AUDIT_READS)
        return ("audit", *reads) if audit.get("federated", True) else ("audit",)
    if stage == "sweep-figures":
        return ("sweeps",)
    return (stage,) if stage in OPTIONAL else ()


# section -> its problems as (problem, the line that says where its fix belongs)
Deferred = dict[str, list[tuple[str, str]]]


def validate_scoped(
    raw: dict[str, Any],
    files: list[str | Path],
    overrides: dict[str, Any] | None = None,
    check_files: bool = False,
) -> tuple[Config, Deferred]:
    """The config, and each optional section's problems (located like every other).

    Raises ConfigError for a problem of the main grid (what `make run` builds), exactly as
    `dpadapter.validation.compose.validate_files` does; an optional section's problems are left out
    of
    the raise and returned instead, keyed by the section's name.
    """
    cfg, problems = check_files_of(raw, files, overrides, check_files)
    at = functools.partial(
        locate,
        files=files,
        overrides=overrides,
        own=functools.partial(check, check_files=check_files),
        defaults=cfg.to_dict(),
    )
    main = [p for p in problems if section_of(p) is None]
    if main:
        raise at(error(main))
    rest = [p for p in problems if section_of(p) is not None]
    lines = str(at(error(rest))).split("\n")[1:] if rest else []
    if len(lines) != len(rest):  # a problem of several lines: one at a time
        lines = [str(at(error([p]))).split("\n", 1)[1] for p in rest]
    deferred: Deferred = {}
    for p, line in zip(rest, lines, strict=True):
        deferred.setdefault(section_of(p), []).append((p, line))
    if rest:  # locating may have read the base alone, its image folders under its data.root
        for split in (cfg.public, *cfg.tasks.values()):
            resolve_dataset(split.dataset, cfg.data.root, missing_ok=True, fresh=True)
    return cfg, deferred


def _message(deferred: Deferred, wanted: tuple[str, ...] | None) -> str:
    parts = []
    for section, found in deferred.items():
        lines = [line for p, line in found if wanted is None or needed(p, wanted)]
        if lines:
            run = OPTIONAL[section]
            parts.append(f"the `{section}` section (run by `{run}`, not by `make run`):")
            parts += lines
    return "\n".join(parts)


def refusal(deferred: Deferred, target: str, raw: dict[str, Any]) -> str | None:
    """The message that stops `target` (see `stage_sections`), or None when what it reads is
    fine."""
    text = _message(deferred, stage_sections(target, raw))
    return f"invalid config: {text}" if text else None


def warning(deferred: Deferred) -> str | None:
    """One warning for a run that does not need the broken sections: what waits, and where."""
    if not deferred:
        return None
    return (
        "warning: sections this run does not use do not fit this config; their own targets "
        "refuse to start until they are fixed:\n" + _message(deferred, None)
    )
