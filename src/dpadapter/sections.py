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

from dpadapter.config import Config, ConfigError, config_chain, key_lines
from dpadapter.problems import OPTIONAL, error, locate, section_of
from dpadapter.validation import check


def stage_sections(stage: str, raw: dict[str, Any] | None = None) -> tuple[str, ...]:
    """The optional sections that a job of `stage` (a `python -m dpadapter` subcommand) or a
    target of the workflow (`hpo`, `federated`, `sweeps`, `audit`, `validity`) reads.

    `validate` checks every one; validity reads the HPO and federated summaries; the audit reads
    `federated` too when it audits federated mechanisms (`audit.federated` of the config `raw`,
    on by default); the main grid's stages read none.
    """
    if stage == "validate":
        return tuple(OPTIONAL)
    if stage == "validity":
        return ("hpo", "federated")
    if stage == "audit":
        audit = (raw or {}).get("audit") or {}
        return ("audit", "federated") if audit.get("federated", True) else ("audit",)
    if stage == "sweep-figures":
        return ("sweeps",)
    return (stage,) if stage in OPTIONAL else ()


def _header(section: str) -> str:
    return f"the `{section}` section (run by `{OPTIONAL[section]}`, not by `make run`):"


def validate_scoped(
    raw: dict[str, Any],
    files: list[str | Path],
    overrides: dict[str, Any] | None = None,
    check_files: bool = False,
) -> tuple[Config, dict[str, str]]:
    """The config, and each optional section's problems as a message (located like every other).

    Raises ConfigError for a problem of the main grid (what `make run` builds), exactly as
    `dpadapter.validation.validate_files` does; a section with problems is left out of the
    raise and returned instead, keyed by its name.
    """
    for f in files:
        if Path(f).is_file():
            for part in config_chain(f):  # duplicates refused, as validate_files does
                if part.suffix != ".json":
                    key_lines(part)
    try:
        cfg, problems = check(raw, check_files)
    except ConfigError as exc:
        raise locate(exc, files, overrides) from None
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
    deferred = {}
    for section in OPTIONAL:
        mine = [p for p in problems if section_of(p) == section]
        if mine:
            deferred[section] = str(at(error(mine, _header(section))))
    return cfg, deferred


def refusal(deferred: dict[str, str], target: str, raw: dict[str, Any]) -> str | None:
    """The message that stops `target` (see `stage_sections`), or None when its sections are
    fine."""
    found = [deferred[s] for s in stage_sections(target, raw) if s in deferred]
    return "invalid config: " + "\n".join(found) if found else None


def warning(deferred: dict[str, str]) -> str | None:
    """One warning for a run that does not need the broken sections: what waits, and where."""
    if not deferred:
        return None
    return (
        "warning: sections this run does not use do not fit this config; their own targets "
        "refuse to start until they are fixed. " + "\n".join(deferred.values())
    )
