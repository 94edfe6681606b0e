"""The config's JSON schema (`workflow/schemas/config.schema.yaml`) and its errors rendered
one line per bad key, each starting with the full dotted key (`dpadapter.settings.errors`).

The schema as written knows no registry; `dpadapter.validation.compose.full_schema` plugs each
registered method's and algorithm's params schema into it.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from dpadapter.ground.param_schema import mixed_alternatives
from dpadapter.settings.errors import ConfigError

REPO_ROOT = Path(__file__).resolve().parents[3]
SCHEMA_PATH = REPO_ROOT / "workflow" / "schemas" / "config.schema.yaml"


# libyaml's parser where PyYAML was built with it: the same tree from the same safe constructor,
# about 8x faster than the pure-Python one on this 27 kB file (50 -> 6 ms of CPU, 2026-11-28,
# machine vm), which every job, Snakemake run and validation parses once.
_SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def base_schema() -> dict[str, Any]:
    """The config's JSON schema as written, without the registries' params schemas."""
    return yaml.load(SCHEMA_PATH.read_text(), Loader=_SAFE_LOADER)


# A YAML 1.1 float needs a dot: PyYAML reads `1e-5` (and anything quoted) as a string.
_NUMBER_TEXT = re.compile(r"^\s*[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?\s*$")


def _schema_message(err: Any) -> list[str]:
    """Lines for one jsonschema error, each starting with the full dotted key it concerns."""
    where = ".".join(str(p) for p in err.absolute_path)
    if err.validator == "additionalProperties" and isinstance(err.instance, dict):
        known = sorted(err.schema.get("properties", {}))
        what = "parameter" if err.schema.get("x-params") else "key"
        return [
            f"{where + '.' if where else ''}{k}: unknown {what}; known: {known}"
            for k in err.instance
            if k not in known
        ]
    mixed = mixed_alternatives(err, where)
    if mixed:
        return [mixed]
    msg = err.message
    if isinstance(err.instance, str) and _NUMBER_TEXT.match(err.instance):
        mantissa, *exponent = re.split("[eE]", err.instance.strip())
        if exponent and "." not in mantissa:
            fixed = f"{mantissa}.0e{exponent[0]}"
            msg += f" (YAML reads an exponent without a dot as text: write {fixed})"
        else:
            msg += f" (a number in quotes is text: write {err.instance.strip()} unquoted)"
    return [f"{where or '<top level>'}: {msg}"]


def validate_raw(raw: dict[str, Any], schema: dict[str, Any] | None = None) -> None:
    """Check the raw mapping against the JSON schema; raise ConfigError naming every bad key.

    `schema` defaults to the file as written; `dpadapter.validation.compose` passes it with the
    registries' params schemas plugged in.
    """
    import jsonschema

    validator = jsonschema.Draft202012Validator(schema or base_schema())
    errors = sorted(validator.iter_errors(raw), key=lambda e: [str(p) for p in e.absolute_path])
    if errors:
        lines = [line for err in errors for line in _schema_message(err)]
        raise ConfigError("invalid config:\n" + "\n".join(f"  {line}" for line in lines))
