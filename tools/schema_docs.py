"""The option tables of the docs, rendered from the config schema.

    python tools/schema_docs.py           # rewrite every generated table in docs/*.md
    python tools/schema_docs.py --check   # exit 1 naming each stale table and each key no table has

A table lives between `<!-- options:begin NAME -->` and `<!-- options:end -->` in any file of
docs/. NAME is a config key (`hpo`, `pretrain.params`) or `top` (the top-level scalars); the
table lists NAME and every key below it, except those under a more specific NAME that has a
table of its own. Types, allowed values and descriptions come from the schema the workflow
validates with (`dpadapter.validation.compose.full_schema`: the file plus every registered method's and
algorithm's params); defaults from the dataclasses and the registries' `default_params()`, which
is where the code takes them from. Hand-written tables drift from the schema as keys move; these
are checked against it by tests/tools/test_schema_docs.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
BEGIN = re.compile(r"<!-- options:begin (\S+) -->\n")
END = "<!-- options:end -->"
TOP = "top"
HEADER = "| key | type | default | allowed | description |\n|---|---|---|---|---|\n"
_REQUIRED = object()
_NONE = object()


@dataclasses.dataclass(frozen=True)
class Row:
    path: str
    type: str
    default: str
    allowed: str
    description: str


# --- defaults, from where the code takes them -------------------------------------------------


def _field_defaults(prefix: str, obj: Any, out: dict[str, Any]) -> None:
    """Each field of a dataclass (instance: its values; class: its declared defaults)."""
    for f in dataclasses.fields(obj):
        if not isinstance(obj, type):
            value = getattr(obj, f.name)
        elif f.default is not dataclasses.MISSING:
            value = f.default
        elif f.default_factory is not dataclasses.MISSING:
            value = f.default_factory()
        else:
            value = _REQUIRED
        key = f"{prefix}.{f.name}" if prefix else f.name
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            _field_defaults(key, value, out)
        else:
            out[key] = value


def defaults() -> dict[str, Any]:
    """Default of every config key the code fills in, by dotted path (`<name>`, `[]` as in rows)."""
    from dpadapter import settings as c
    from dpadapter.algorithms import ALGORITHMS
    from dpadapter.upstream import UPSTREAMS

    out: dict[str, Any] = {}
    top: dict[str, Any] = {}
    _field_defaults("", c.Config, top)
    for name in ("seed", "results_dir", "device", "tf32"):
        out[name] = top[name]
    sections = {
        "data": c.DataConfig(),
        "public": c.SplitConfig,
        "tasks.<name>": c.SplitConfig,
        "model": c.ModelConfig(),
        "warmup": c.SGDConfig(),
        "finetune": c.FinetuneConfig(),
        "finetune.extra_grids[]": c.GridConfig,
        "privacy": c.PrivacyConfig(),
        "robustness": c.RobustnessConfig(),
        "tracking": c.TrackingConfig(),
        "sweeps": c.SweepConfig(),
        "hpo": c.HPOConfig(),
        "federated": c.FederatedConfig(),
        "audit": c.AuditConfig(),
        "reference": c.ReferenceConfig,
        "reference.cells[]": c.ReferenceCell,
    }
    for prefix, obj in sections.items():
        _field_defaults(prefix, obj, out)
    out["data.normalization"] = None  # the dataclass holds it as a (mean, std) pair
    out["pretrain.methods"] = c.DEFAULT_METHODS
    out["pretrain.params"] = {}
    for name, cls in UPSTREAMS.items():
        for k, v in cls.default_params().items():
            out[f"pretrain.params.{name}.{k}"] = v
    for name, cls in ALGORITHMS.items():
        for k, v in cls.default_params().items():
            out[f"finetune.algo_params.{name}.{k}"] = v
    return out


# --- rows, from the schema ---------------------------------------------------------------------


def _plain(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return format(value, "g")
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_plain(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_plain(v)}" for k, v in value.items()) + "}"
    return str(value) if value != "" else '""'


def _resolve(node: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    ref = node.get("$ref")
    if ref:
        return schema["$defs"][ref.rsplit("/", 1)[1]]
    return node


_TYPE_OF = {str: "string", bool: "boolean", int: "integer", float: "number", type(None): "null"}


def _type(node: dict[str, Any], schema: dict[str, Any]) -> str:
    node = _resolve(node, schema)
    if "oneOf" in node:
        return " or ".join(dict.fromkeys(_type(n, schema) for n in node["oneOf"]))
    if "const" in node:
        return _TYPE_OF[type(node["const"])]
    if "enum" in node and "type" not in node:
        return " or ".join(dict.fromkeys(_TYPE_OF[type(v)] for v in node["enum"]))
    types = node.get("type", "any")
    types = types if isinstance(types, list) else [types]
    shown = []
    for t in types:
        if t == "array" and "items" in node:
            shown.append(f"array of {_type(node['items'], schema)}")
        elif t == "object" and isinstance(node.get("additionalProperties"), dict):
            inner = _resolve(node["additionalProperties"], schema)
            what = "mapping" if "properties" not in inner else "mapping of objects"
            shown.append(what if "type" not in inner else f"mapping to {_type(inner, schema)}")
        else:
            shown.append(t)
    return " or ".join(shown)


def _bounds(node: dict[str, Any]) -> str:
    lo = ("[", node["minimum"]) if "minimum" in node else None
    lo = ("(", node["exclusiveMinimum"]) if "exclusiveMinimum" in node else lo
    hi = ("]", node["maximum"]) if "maximum" in node else None
    hi = (")", node["exclusiveMaximum"]) if "exclusiveMaximum" in node else hi
    if lo and hi:
        return f"{lo[0]}{_plain(lo[1])}, {_plain(hi[1])}{hi[0]}"
    if lo:
        return f"{'≥' if lo[0] == '[' else '>'} {_plain(lo[1])}"
    if hi:
        return f"{'≤' if hi[0] == ']' else '<'} {_plain(hi[1])}"
    return ""


def _allowed(node: dict[str, Any], schema: dict[str, Any]) -> str:
    node = _resolve(node, schema)
    parts = []
    if "oneOf" in node:
        alts = [_allowed(n, schema) or _type(n, schema) for n in node["oneOf"]]
        return " or ".join(a for a in alts if a)
    if "const" in node:
        parts.append(f"`{_plain(node['const'])}`")
    if "enum" in node:
        parts.append(", ".join(f"`{_plain(v)}`" for v in node["enum"]))
    if bounds := _bounds(node):
        parts.append(bounds)
    if "pattern" in node:
        parts.append(f"`{node['pattern']}`")
    names = node.get("propertyNames", {}).get("pattern")
    if names:
        parts.append(f"names `{names}`")
    if "minProperties" in node:
        parts.append(f"at least {node['minProperties']}")
    if "items" in node:
        items = _allowed(node["items"], schema)
        lo, hi = node.get("minItems"), node.get("maxItems")
        if lo is not None and lo == hi:
            parts.append(f"{lo} items")
        elif lo is not None and hi is not None:
            parts.append(f"{lo}–{hi} items")
        elif lo:
            parts.append(f"at least {lo} item{'s' if lo > 1 else ''}")
        if node.get("uniqueItems"):
            parts.append("unique")
        if items:
            parts.append(f"each {items}")
    if isinstance(node.get("additionalProperties"), dict):
        inner = _resolve(node["additionalProperties"], schema)
        if "properties" not in inner and (values := _allowed(inner, schema)):
            parts.append(f"values {values}")
    return "; ".join(parts)


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def rows(schema: dict[str, Any] | None = None) -> list[Row]:
    """A row for every key of the schema, parents first, in the schema's order."""
    if schema is None:
        from dpadapter.validation.compose import full_schema

        schema = full_schema()
    known = defaults()
    out: list[Row] = []

    def visit(node: dict[str, Any], path: str, required: bool) -> None:
        node = _resolve(node, schema)
        default = _REQUIRED if required else known.get(path, _NONE)
        if default is _REQUIRED:
            shown = "required"
        elif default is _NONE:
            shown = ""
        else:
            shown = f"`{_plain(default)}`"
        desc = node.get("description", "")
        allowed = _cell(_allowed(node, schema))
        out.append(Row(path, _type(node, schema), shown, allowed, _cell(desc)))
        children(node, path)

    def children(node: dict[str, Any], path: str) -> None:
        need = set(node.get("required", ()))
        for key, sub in node.get("properties", {}).items():
            visit(sub, f"{path}.{key}" if path else key, key in need)
        extra = node.get("additionalProperties")
        if isinstance(extra, dict) and "properties" in _resolve(extra, schema):
            visit(extra, f"{path}.<name>", False)
        items = node.get("items")
        if isinstance(items, dict) and "properties" in _resolve(items, schema):
            children(_resolve(items, schema), f"{path}[]")

    children(schema, "")
    return out


# --- regions of the docs -----------------------------------------------------------------------


def _under(path: str, name: str) -> bool:
    return path == name or path.startswith(f"{name}.") or path.startswith(f"{name}[")


def owner(path: str, names: set[str]) -> str | None:
    """The region a key's row goes to: the most specific name above it (`top` for the rest
    of the top-level keys that are not sections)."""
    mine = [n for n in names if n != TOP and _under(path, n)]
    if mine:
        return max(mine, key=len)
    if TOP in names and "." not in path and "[" not in path:
        return TOP
    return None


def table(name: str, all_rows: list[Row], names: set[str]) -> str:
    lines = [
        f"| `{r.path}` | {r.type} | {r.default} | {r.allowed} | {r.description} |\n"
        for r in all_rows
        if owner(r.path, names) == name
    ]
    return HEADER + "".join(lines)


def regions(text: str) -> list[tuple[str, int, int]]:
    """(name, start, end) of each generated region's content in `text`."""
    out = []
    for m in BEGIN.finditer(text):
        end = text.find(END, m.end())
        if end < 0:
            raise ValueError(f"options:begin {m.group(1)} has no {END}")
        out.append((m.group(1), m.end(), end))
    return out


def doc_files(docs: Path = DOCS) -> list[Path]:
    return sorted(docs.glob("*.md"))


def render(texts: dict[Path, str], all_rows: list[Row] | None = None) -> dict[Path, str]:
    """Every file's text with each region's table regenerated."""
    all_rows = rows() if all_rows is None else all_rows
    names = {n for t in texts.values() for n, _, _ in regions(t)}
    out = {}
    for path, text in texts.items():
        for name, start, end in reversed(regions(text)):
            text = text[:start] + table(name, all_rows, names) + text[end:]
        out[path] = text
    return out


def problems(texts: dict[Path, str], all_rows: list[Row] | None = None) -> list[str]:
    """Stale tables, keys no table lists, regions named twice or matching no key."""
    all_rows = rows() if all_rows is None else all_rows
    found: dict[str, Path] = {}
    out = []
    for path, text in texts.items():
        for name, _, _ in regions(text):
            if name in found:
                out.append(f"{path.name}: options table {name!r} is also in {found[name].name}")
            found[name] = path
    names = set(found)
    for r in all_rows:
        if owner(r.path, names) is None:
            out.append(
                f"config key {r.path} is in no options table: add "
                f"`<!-- options:begin {r.path.split('.')[0]} -->` ... `{END}` to a doc in docs/"
            )
    for name in sorted(names):
        if not any(owner(r.path, names) == name for r in all_rows):
            out.append(f"{found[name].name}: options table {name!r} names no config key")
    for path, new in render(texts, all_rows).items():
        if new != texts[path]:
            old = texts[path]
            stale = [n for n, s, e in regions(old) if old[s:e] != table(n, all_rows, names)]
            out.append(
                f"{path.name}: options table(s) {', '.join(stale)} out of date with the schema: "
                "run `python tools/schema_docs.py`"
            )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 if stale")
    args = ap.parse_args(argv)
    texts = {p: p.read_text() for p in doc_files()}
    all_rows = rows()
    found = problems(texts, all_rows)
    if args.check:
        print("\n".join(found) or "options tables up to date")
        return 1 if found else 0
    for path, text in render(texts, all_rows).items():
        if text != texts[path]:
            path.write_text(text)
            print(f"rewrote {path.relative_to(REPO)}")
    left = problems({p: p.read_text() for p in doc_files()}, all_rows)
    if left:
        print("\n".join(left), file=sys.stderr)
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main())
