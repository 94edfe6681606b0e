"""JSON schemas of the params a registered method or algorithm takes, and their error messages.

Each upstream method and DP algorithm declares `params_schema` beside its `default_params()`;
the config validation (`dpadapter.validation.compose`) plugs those schemas into the config schema,
so a
typo or a wrong type in `pretrain.params.<method>` or `finetune.algo_params.<algo>` is refused
by name before any job is scheduled, and the classes check the same schema when constructed.
This module imports nothing of the package, so the registries and the config can both use it.
"""

from __future__ import annotations

from typing import Any

# Reusable property schemas; ranges are those the code can run with, not tuning advice.
POSITIVE_INT: dict[str, Any] = {"type": "integer", "minimum": 1}
NON_NEGATIVE_INT: dict[str, Any] = {"type": "integer", "minimum": 0}
POSITIVE: dict[str, Any] = {"type": "number", "exclusiveMinimum": 0}
NON_NEGATIVE: dict[str, Any] = {"type": "number", "minimum": 0}
FRACTION: dict[str, Any] = {"type": "number", "minimum": 0, "maximum": 1}


def params_object(**properties: dict[str, Any]) -> dict[str, Any]:
    """An object schema of exactly these params (every one optional: defaults fill the rest).

    `x-params` (ignored by JSON schema) makes the config's messages say "unknown parameter".
    """
    return {
        "type": "object",
        "additionalProperties": False,
        "properties": dict(properties),
        "x-params": True,
    }


def by_epsilon(value: dict[str, Any]) -> dict[str, Any]:
    """A per-target-epsilon table {epsilon: value} (papers tune e.g. the SAM radius per epsilon)."""
    return {"type": ["object", "null"], "additionalProperties": value}


def nullable(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema`, or null (a param whose None means "derive it", e.g. adpclip's count_noise)."""
    types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
    return {**schema, "type": [*types, "null"]}


def mixed_alternatives(err: Any, where: str) -> str | None:
    """For a `oneOf` of mappings told apart by their required key (an external upstream's
    `weights: {file}` / `{hub}` / `{torchvision}`), a value holding several of those keys:
    which, and what to write. The usual cause is an overlay: its mapping is merged into the
    base's, so a base's `{hub: true}` and an overlay's `{file: x}` become both, which jsonschema
    only calls "not valid under any of the given schemas"."""
    if err.validator != "oneOf" or not isinstance(err.instance, dict):
        return None
    alternatives = [a for a in err.validator_value if isinstance(a, dict)]
    keys = [
        a["required"][0]
        for a in alternatives
        if a.get("type") == "object" and len(a.get("required", ())) == 1
    ]
    given = [k for k in keys if k in err.instance]
    if len(given) < 2:
        return None
    # the merged mapping lists the base's keys first: the last one is most likely the overlay's
    kept = [k for k in err.instance if k in given][-1]
    return (
        f"{where}: one of {', '.join(keys)}, not {' and '.join(given)} together. An overlay's "
        f"`{where.rsplit('.', 1)[-1]}:` is merged into its base's: to replace the base's, write "
        f"`unset: [{where}]` in the overlay beside its own value "
        f"(`{where.rsplit('.', 1)[-1]}: {{{kept}: {err.instance[kept]}}}`)"
    )


def param_errors(schema: dict[str, Any], params: Any, where: str) -> list[str]:
    """Every problem of `params` against `schema`, each naming the full key (`where.<param>`)."""
    import jsonschema

    if not isinstance(params, dict):
        return [f"{where}: {params!r} is not a mapping of parameters"]
    known = sorted(schema.get("properties", {}))
    out = [
        f"{where}.{k}: unknown parameter; known: {known}"
        for k in params
        if schema.get("additionalProperties") is False and k not in known
    ]
    validator = jsonschema.Draft202012Validator(schema)
    for err in sorted(validator.iter_errors(params), key=lambda e: list(e.absolute_path)):
        if err.validator == "additionalProperties" and not err.absolute_path:
            continue  # reported above with the known names
        path = ".".join(str(p) for p in err.absolute_path)
        at = f"{where}.{path}" if path else where
        out.append(mixed_alternatives(err, at) or f"{at}: {err.message}")
    return out
