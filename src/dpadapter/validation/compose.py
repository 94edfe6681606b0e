"""Every check of a config, composed before any job starts; each feature owns its own.

`dpadapter.settings` holds the sections (each checks what it can tell alone), the JSON schema
check and the parsing, and imports no registry (the registries import its dataclasses). This
module sits above both and only composes: it plugs each registered method's and algorithm's
`params_schema` into the config schema, then asks each feature for its problems, in one
order (the order of the messages): the data (`dpadapter.data.checks`: dataset names, classes
and pool sizes from the registry's declared counts, no data loaded), the main grid's stages
(`dpadapter.stages.checks`: fine-tuning names, the privacy budget its grid can reach, the
published table), the upstream methods and the gamma sweeps (`dpadapter.upstream.checks`),
HPO, federated and audit (`dpadapter.<feature>.checks`). The workflow
(`workflow/rules/common.smk`) and the CLI (`python -m dpadapter`) call `validate` / `load`;
every message names the full key.

The workflow validates while Snakemake parses, so this module imports no torch, Opacus or
MLflow: the registries are read through `dpadapter.registries.catalog` (names, params schemas,
flags).
Only a config naming an external backbone imports its method (timm's pretrained_cfg, the
weights' location), in `dpadapter.upstream.checks`.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Collection
from pathlib import Path
from typing import Any

from dpadapter.audit import checks as audit_checks
from dpadapter.data import checks as data_checks
from dpadapter.federated import checks as federated_checks
from dpadapter.hpo import checks as hpo_checks
from dpadapter.registries import catalog
from dpadapter.settings import (
    Config,
    ConfigError,
    base_schema,
    config_chain,
    key_lines,
    read_raw,
    validate_raw,
)
from dpadapter.settings import from_dict as _parse
from dpadapter.settings.problems import blocking, error, locate
from dpadapter.stages import checks as stage_checks
from dpadapter.upstream import checks as upstream_checks
from dpadapter.upstream.checks import only_backbones, variant_problems
from dpadapter.upstream.resolve import EXTERNAL

__all__ = [
    "ConfigError",
    "full_schema",
    "load",
    "validate",
    "validate_files",
    "variant_problems",
]


def full_schema() -> dict[str, Any]:
    """The config schema with every registered method's and algorithm's params schema in it."""
    return copy.deepcopy(_full_schema())


@functools.cache
def _full_schema() -> dict[str, Any]:  # parsing the schema's YAML costs 0.1 s; once a process
    schema = base_schema()
    props = schema["properties"]

    def plug(section: dict[str, Any], key: str, registry: dict[str, Any], what: str) -> None:
        section["properties"][key] = {
            "type": "object",
            "description": f"per-{what} hyperparameters, keyed by registry name",
            "additionalProperties": False,
            "properties": {name: e.params_schema for name, e in registry.items()},
        }

    upstreams, algorithms = catalog.upstreams(), catalog.algorithms()
    plug(props["pretrain"], "params", upstreams, "method")
    props["pretrain"]["properties"]["external"]["additionalProperties"] = upstreams[
        EXTERNAL
    ].params_schema
    plug(props["finetune"], "algo_params", algorithms, "algorithm")
    plug(
        props["finetune"]["properties"]["algo_params_for"]["items"],
        "algo_params",
        algorithms,
        "algorithm",
    )
    return schema


def validate(
    raw: dict[str, Any], check_files: bool = False, sections: tuple[str, ...] | None = None
) -> Config:
    """Schema (with the registries' params schemas), parsing, then every cross-field check.

    `check_files` also looks for each dataset's files (the workflow does; a job's CLI does not,
    as its loader reports missing files itself). `sections`: the optional sections whose
    problems count (`dpadapter.settings.problems.blocking`; None: all of them).
    """
    cfg, problems = check(raw, check_files)
    problems = blocking(problems, sections)
    if problems:
        raise error(problems)
    return cfg


def check(raw: dict[str, Any], check_files: bool = False) -> tuple[Config, list[str]]:
    """The parsed config and every cross-field problem (`key: text`); schema errors raise."""
    raw = copy.deepcopy(raw)
    validate_raw(raw, _full_schema())
    cfg = _parse(raw, validate=False)
    problems = data_checks.family_problems(cfg, check_files)
    names = data_checks.name_problems(cfg)
    names += stage_checks.algorithm_problems(cfg)
    names += upstream_checks.method_problems(cfg)
    names += stage_checks.grid_problems(cfg)
    names += upstream_checks.sweep_problems(cfg)
    problems += list(dict.fromkeys(names))  # a name missing from two lists is said once
    problems += upstream_checks.label_problems(cfg)
    problems += hpo_checks.problems(cfg)
    problems += federated_checks.problems(cfg)
    problems += data_checks.data_problems(cfg)
    problems += stage_checks.privacy_problems(cfg)
    problems += stage_checks.reference_problems(cfg)
    problems += audit_checks.problems(cfg)
    if check_files:
        problems += data_checks.file_problems(cfg)
        problems += upstream_checks.weight_problems(cfg)
    # the backbone is built (on the meta device) only from a main grid without problems
    if not blocking(problems, ()):
        problems += upstream_checks.backbone_problems(cfg, check_files)
    return cfg, problems


def load(
    path: str | Path,
    overrides: dict[str, Any] | None = None,
    check_files: bool = False,
    sections: tuple[str, ...] | None = None,
) -> Config:
    return validate_files(read_raw(path, overrides), [path], overrides, check_files, sections)


def check_files_of(
    raw: dict[str, Any],
    files: list[str | Path],
    overrides: dict[str, Any] | None,
    check_files: bool,
) -> tuple[Config, list[str]]:
    """`check` of `raw` after its files' duplicate keys are refused (an overlay's bases too);
    a schema error is pointed at its file and line. The shared first half of `validate_files`
    and `dpadapter.validation.optional_sections.validate_scoped`."""
    for f in files:
        if Path(f).is_file():
            for part in config_chain(f):
                if part.suffix != ".json":
                    key_lines(part)
    try:
        return check(raw, check_files)
    except ConfigError as exc:
        raise locate(exc, files, overrides) from None


def validate_files(
    raw: dict[str, Any],
    files: list[str | Path],
    overrides: dict[str, Any] | None = None,
    check_files: bool = False,
    sections: tuple[str, ...] | None = None,
    backbones: Collection[str] | None = None,
    cells: Collection[tuple[str, float]] | None = None,
) -> Config:
    """`validate` for `raw` merged from `files` (and `overrides`), each problem pointed at the
    file and line where its fix belongs (`dpadapter.settings.problems.locate`).

    `backbones`: the upstreams whose backbone is checked (a job checks only the one it builds;
    the workflow checked them all before any job). None: all.

    `cells`: the (task, epsilon) cells whose reach under the calibration is checked (a job
    checks only the one it trains, `dpadapter.stages.checks.only_cells`). None: all.

    Each file (and each `base:` it builds on) is read again for its key lines: whoever loaded
    `raw` (Snakemake's `--configfile` loader, PyYAML) kept the later of two equal keys silently,
    so a duplicate is refused here, naming both lines; every other problem gets `file:line:` of
    the key it names.
    """
    with only_backbones(backbones), stage_checks.only_cells(cells):
        cfg, problems = check_files_of(raw, files, overrides, check_files)
        problems = blocking(problems, sections)
        if problems:
            own = functools.partial(check, check_files=check_files)  # the base's own problems
            raise locate(error(problems), files, overrides, own=own, defaults=cfg.to_dict())
    return cfg
