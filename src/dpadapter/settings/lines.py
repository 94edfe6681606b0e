"""Where a key of a merged config is written: the file and line of each key, and a
ConfigError with each problem line pointed at them (`file:line: key: ...`).

`dpadapter.settings.problems.locate` builds on these to point a problem at the file where its fix
belongs (an overlay or its base); `locate` here is the plain rule `load` uses.
"""

from __future__ import annotations

import contextlib
import re
from pathlib import Path
from typing import Any

import yaml

from dpadapter.settings.errors import ConfigError
from dpadapter.settings.files import (
    BASE_KEY,
    UNSET_KEY,
    config_chain,
    key_lines,
    merge,
    read_one,
    shown_path,
    unset_keys,
)

# A problem line of a ConfigError: two spaces, a dotted key, ": " (see `_schema_message`).
_PROBLEM = re.compile(r"^  ([^\s:]+): ", re.M)


def override_holds(overrides: dict[str, Any], key: str) -> bool:
    """Whether `key`'s value comes from `overrides` (Snakemake merges them in key by key)."""
    node: Any = overrides
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
        if not isinstance(node, dict):
            return True
    return True


def locate(
    exc: ConfigError, files: list[str | Path], overrides: dict[str, Any] | None = None
) -> ConfigError:
    """`exc` with each problem line prefixed by where its key is written: `file:line: key: ...`.

    `files` are merged in order (a later file wins), each with its chain of `base:` files
    (`key_origins`: the file of the chain the merged value comes from), so a key is pointed at
    the last file that writes the deepest part of its path; a key no file writes (a default the
    check refers to) at its nearest enclosing section. Keys set by `overrides` (Snakemake's
    `--config`) say so.
    """
    maps = []
    for f in files:
        # e.g. JSON indented with tabs; a broken chain was refused when it was read
        with contextlib.suppress(OSError, yaml.YAMLError, ConfigError):
            maps.append((shown_path(f), key_origins(f)))

    def where(match: re.Match) -> str:
        key = match.group(1)
        if overrides and override_holds(overrides, key):
            return f"  --config: {key}: "
        best = key_origin(maps, key)
        if best is None:
            return f"  {maps[-1][0]}: {key}: " if maps else match.group(0)
        return f"  {best[1]}:{best[2]}: {key}: "

    return ConfigError(_PROBLEM.sub(where, str(exc)))


def key_origin(maps: list[tuple[str, dict]], key: str) -> tuple[int, str, int] | None:
    """(depth, file, line) of the deepest prefix of `key` that a file sets, the last file
    winning a tie (as the merge does); None when no file sets any of it."""
    parts = key.split(".")
    best: tuple[int, str, int] | None = None
    for _, origins in maps:
        for depth in range(len(parts), 0, -1):
            origin = origins.get(".".join(parts[:depth]))
            if origin is not None:
                if best is None or depth >= best[0]:
                    best = (depth, *origin)
                break
    return best


def _at(raw: Any, key: str) -> Any:
    """The value at dotted `key` of nested mappings, None where there is none."""
    for part in key.split("."):
        raw = raw.get(part) if isinstance(raw, dict) else None
    return raw


def key_origins(path: str | Path) -> dict[str, tuple[str, int]]:
    """(file, line) of every key of the merged config of `path`, by dotted path.

    The same rule as `merge`: a key the overlay writes as a mapping onto a mapping keeps the
    base's entries below it; anything else the overlay writes (a scalar, a list) drops them.
    """
    out: dict[str, tuple[str, int]] = {}
    merged: dict[str, Any] = {}
    for p in config_chain(path):
        name = shown_path(p)
        lines: dict[str, int] = {}
        with contextlib.suppress(yaml.YAMLError):  # e.g. JSON indented with tabs
            lines = key_lines(p)
        layer = read_one(p)
        layer.pop(BASE_KEY, None)
        unset = layer.pop(UNSET_KEY, None)
        if unset is not None:
            merged = unset_keys(merged, unset, p)
            for key in unset:
                out = {k: v for k, v in out.items() if k != key and not k.startswith(key + ".")}
        replaced: list[str] = []
        for key in sorted(lines, key=lambda k: k.count(".")):
            if key.split(".")[0] in (BASE_KEY, UNSET_KEY):
                continue
            if not any(key.startswith(r + ".") for r in replaced) and not (
                isinstance(_at(layer, key), dict) and isinstance(_at(merged, key), dict)
            ):
                out = {k: v for k, v in out.items() if not k.startswith(key + ".")}
                replaced.append(key)
            out[key] = (name, lines[key])
        merged = merge(merged, layer)
    return out
