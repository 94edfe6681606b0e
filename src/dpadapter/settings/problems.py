"""Where a config problem's fix belongs, and which section of the pipeline it stands in the way of.

A problem is a line `  key: message` of a ConfigError. Two questions are answered here, both
without the registries (`dpadapter.validation.compose` finds the problems,
`dpadapter.validation.optional_sections` applies
the answers in the workflow and the jobs):

- Where to fix it (`locate`). A user's overlay names only what differs from its base, so the
  line that holds a key is often not where the fix belongs: an overlay that replaces
  `pretrain.methods` makes the base's `hpo.upstreams: [standard]` wrong, and pointing at the
  base (a shipped file the user did not write) sends them to the wrong file. A problem that the
  base has on its own is pointed at the base; one the overlay brings is pointed at the overlay,
  at the line of the key the message names there, else at the overlay's section or `unset:`.
  A key no file writes (a default of the code) is said to be one, with its value.
- Which section it belongs to (`section_of`). `hpo`, `federated`, `sweeps` and `audit` are run
  by their own targets (`make hpo`, ...), never by `make run`: their problems wait for those
  targets instead of stopping the main grid.
"""

from __future__ import annotations

import contextlib
import functools
import json
import re
from collections.abc import Callable, Iterable
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
    read_chain,
    read_files,
    shown_path,
)
from dpadapter.settings.lines import key_origin, key_origins, override_holds
from dpadapter.settings.schema import base_schema

# Sections run only by their own targets (workflow/rules/<section>.smk), with the make target
# that runs each.
OPTIONAL = {
    "hpo": "make hpo",
    "federated": "make federated",
    "sweeps": "make sweeps",
    "audit": "make audit",
}

# A problem line of a ConfigError: two spaces, a dotted key (or `<top level>`), ": ", the text.
_LINE = re.compile(r"^  (<top level>|[^\s:]+): (.*)$")
# Dotted keys a message names (`pretrain.methods`), to find the one the overlay wrote.
_KEY = re.compile(r"\b[a-z_]+(?:\.[A-Za-z0-9_-]+)+\b")
_REQUIRED = re.compile(r"^'([^']+)' is a required property")


def problem_lines(exc: ConfigError) -> list[str]:
    """The problems of `exc` as `key: text` lines (the header and any continuation dropped)."""
    return [f"{m.group(1)}: {m.group(2)}" for m in map(_LINE.match, str(exc).splitlines()) if m]


def key_of(problem: str) -> str:
    """The dotted key of a `key: text` problem."""
    return problem.split(":", 1)[0].strip()


def section_of(problem: str) -> str | None:
    """The optional section a `key: text` problem belongs to; None for the main grid's."""
    top = key_of(problem).split(".", 1)[0]
    return top if top in OPTIONAL else None


def needed(problem: str, sections: Iterable[str]) -> bool:
    """Whether a problem of an optional section concerns `sections`: section names, or keys
    of one where a stage reads only part of it (the audit reads `federated.laplace`, say)."""
    key = key_of(problem)
    return any(key == s or key.startswith(s + ".") for s in sections)


def blocking(problems: Iterable[str], sections: Iterable[str] | None) -> list[str]:
    """The problems that stop a run of `sections` (None: every section, as `validate` always
    did): the main grid's always, an optional section's only when it is asked for."""
    if sections is None:
        return list(problems)
    wanted = tuple(sections)
    return [p for p in problems if section_of(p) is None or needed(p, wanted)]


def error(problems: list[str], header: str = "invalid config:") -> ConfigError:
    return ConfigError(header + "\n" + "\n".join(f"  {p}" for p in problems))


def without_overlay(files: list[str | Path], overrides: dict[str, Any] | None) -> dict | None:
    """The merged config as it is without the last file's own layer (its bases kept); None when
    that file is no overlay (it has no `base:`), so there is nothing to tell apart."""
    if not files:
        return None
    chain = config_chain(files[-1])
    if len(chain) < 2:
        return None
    return up_to(files, overrides, chain[-2])


def up_to(files: list[str | Path], overrides: dict[str, Any] | None, link: Path) -> dict:
    """The merged config as it is with the last file's chain cut after `link` (one of it)."""
    raw = merge(read_files(list(files[:-1])), read_chain(link))
    return merge(raw, dict(overrides or {}))


def _at(tree: Any, key: str) -> Any:
    for part in key.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return None
        tree = tree[part]
    return tree


def _problems(check: Callable[[dict[str, Any]], tuple[Any, list[str]]], raw: dict) -> set[str]:
    """Every problem `check` finds in `raw`, schema errors included."""
    try:
        return set(check(raw)[1])
    except ConfigError as exc:
        return set(problem_lines(exc))


@functools.cache
def _schema() -> dict[str, Any]:
    return base_schema()  # read only once a problem is located; never changed here


def unset_gives(key: str) -> str:
    """What `unset: [key]` in an overlay leaves, by the schema as written: "default" for a
    property it names and does not require (the code fills it in), "drop" for an entry of a
    mapping keyed by the user's own names (`pretrain.external.<label>`, `tasks.<name>`: no code
    default, the entry just goes), "" otherwise (a required key, a list item, a registry's
    params the schema as written does not describe). An overlay's refusal advised `unset:` "for
    the code's default" for an external label, which has none (issue 50)."""
    node: Any = _schema()
    defs = node.get("$defs", {})
    parts = key.split(".")
    for i, part in enumerate(parts):
        while isinstance(node, dict) and "$ref" in node:
            node = defs.get(node["$ref"].rsplit("/", 1)[-1], {})
        if not isinstance(node, dict):
            return ""
        last = i == len(parts) - 1
        props = node.get("properties", {})
        if part in props:
            if last:
                return "" if part in node.get("required", ()) else "default"
            node = props[part]
        elif isinstance(node.get("additionalProperties"), dict) and not part.isdigit():
            if last:
                return "drop"
            node = node["additionalProperties"]
        else:
            return ""
    return ""


def _shown(value: Any) -> str:
    if isinstance(value, tuple | list):
        return "[" + ", ".join(str(v) for v in value) + "]"
    return json.dumps(value) if isinstance(value, dict) else str(value)


class _User:
    """The file the user ran (the last of `files`): its own keys' lines and its `unset:` list."""

    def __init__(self, path: str | Path):
        self.name = shown_path(path)
        self.lines: dict[str, int] = {}
        self.unset: list[str] = []
        self.overlay = False
        with contextlib.suppress(OSError, yaml.YAMLError, ConfigError):
            self.lines = key_lines(path)
            self.overlay = BASE_KEY in self.lines or UNSET_KEY in self.lines
            raw = yaml.safe_load(Path(path).read_text()) or {}
            unset = raw.get(UNSET_KEY) if isinstance(raw, dict) else None
            self.unset = [k for k in unset or () if isinstance(k, str)]

    def line_for(self, key: str, text: str) -> int:
        """The line of this file where `key`'s problem is fixed: a key the message names that
        this file writes, else the file's own entry for the key's section, else the `unset:`
        that removed it (or any `unset:`), else `base:`, else line 1."""
        named = [k for k in _KEY.findall(text) if k in self.lines and k != key]
        if named:
            return self.lines[named[0]]
        parts = key.split(".")
        for depth in range(len(parts), 0, -1):
            if ".".join(parts[:depth]) in self.lines:
                return self.lines[".".join(parts[:depth])]
        for name in (UNSET_KEY, BASE_KEY):
            if name in self.lines:
                return self.lines[name]
        return 1

    def unset_of(self, key: str) -> str | None:
        """The entry of this file's `unset:` that removed `key` (or a section above it)."""
        return next((u for u in self.unset if key == u or key.startswith(u + ".")), None)


def locate(
    exc: ConfigError,
    files: list[str | Path],
    overrides: dict[str, Any] | None = None,
    *,
    own: Callable[[dict[str, Any]], tuple[Any, list[str]]] | None = None,
    defaults: dict[str, Any] | None = None,
) -> ConfigError:
    """`exc` with each problem prefixed by where its fix belongs: `file:line: key: ...`.

    `files` are merged in order (a later file wins), each with its chain of `base:` files. A key
    is pointed at the last file that writes the deepest part of its path, except where the last
    file is an overlay that brought the problem: `own(raw)` checks a merged config `raw` (as
    `dpadapter.validation.compose.check` does: the config and its problems; schema errors raise),
    and a
    problem the config without the overlay's layer does not have is the overlay's to fix (the
    message says which file holds the value). A key no file writes is a default: `defaults`
    (the parsed config as a dict) gives its value. Keys set by `overrides` (Snakemake's
    `--config`) say so.
    """
    maps = []
    for f in files:
        # e.g. JSON indented with tabs; a broken chain was refused when it was read
        with contextlib.suppress(OSError, yaml.YAMLError, ConfigError):
            maps.append((shown_path(f), key_origins(f)))
    user = _User(files[-1]) if files else None
    chain: list[Path] = []
    with contextlib.suppress(OSError, yaml.YAMLError, ConfigError):
        chain = config_chain(files[-1]) if files else []
    level_own: dict[int, set[str] | None] = {}

    def own_at(k: int) -> set[str] | None:
        """The problems of the config with the user's chain cut after its `k`-th file."""
        if k not in level_own:
            raw = None
            with contextlib.suppress(OSError, yaml.YAMLError, ConfigError):
                raw = up_to(files, overrides, chain[k])
            level_own[k] = None if raw is None else _problems(own, raw)
        return level_own[k]

    def brought_by(problem: str) -> _User | None:
        """The file of the user's chain whose layer brought `problem`: the lowest one above
        which every cut of the chain has it (an overlay's base several files down, not only
        the user's own file); None when the chain's furthest base has it on its own, or when
        that cannot be told. A warning caused by the `unset:` of a base three files down was
        pointed at config.yaml (issue 50)."""
        if own is None or user is None or not user.overlay or len(chain) < 2:
            return None
        for k in range(len(chain) - 2, -1, -1):
            found = own_at(k)
            if found is None:
                return None
            if problem not in found:
                return user if k == len(chain) - 2 else _User(chain[k + 1])
        return None

    def origin_of(key: str) -> tuple[int, str, int] | None:
        return key_origin(maps, key)

    def default_note(key: str) -> str:
        value = _at(defaults, key) if defaults else None
        what = f"the code's default, {_shown(value)}" if value is not None else "a default"
        there = f"; write it in {user.name}" if user is not None else ""
        return f" (no config file writes {key}: {what} applies{there})"

    def where(line: str) -> str:
        m = _LINE.match(line)
        if not m:
            return line
        key, text = m.groups()
        if key == "<top level>":
            required = _REQUIRED.match(text)
            if user is None or required is None:
                return line
            name = required.group(1)
            gone = user.unset_of(name)
            note = f" (removed by `unset: [{gone}]`: every config needs it)" if gone else ""
            at = user.lines.get(UNSET_KEY, 1) if gone else 1
            return f"  {user.name}:{at}: {name}: {text}{note}"
        if overrides and override_holds(overrides, key):
            return f"  --config: {key}: {text}"
        best = origin_of(key)
        exact = best is not None and best[0] == len(key.split("."))
        note = "" if exact else default_note(key)
        if user is None:
            return line if best is None else f"  {best[1]}:{best[2]}: {key}: {text}{note}"
        mine = exact and best[1] == user.name
        by = None
        if user.overlay and not mine:
            by = user if best is None else brought_by(f"{key}: {text}")
        if by is not None and not (exact and best[1] == by.name):
            here = "here" if by is user else f"in {by.name}"
            gone = by.unset_of(key)
            if gone is not None:
                value = _at(defaults, key) if defaults else None
                note = (
                    f" (`unset: [{gone}]` {here} leaves {key} to the code's default"
                    + (f", {_shown(value)}" if value is not None else "")
                    + f": write {key} in {user.name})"
                )
            elif exact:
                whose = "this file's" if by is user else f"{by.name}'s"
                note = f" ({key} is written at {best[1]}:{best[2]}, which {whose} changes "
                note += {
                    "default": f"make wrong: set {key} in {user.name}, or add it to `unset:` "
                    "there for the code's default)",
                    # an entry has no default: what is wrong is that it is there
                    "drop": f"make wrong: drop it with `unset: [{key}]` in {user.name}; an "
                    "entry has no code default)",
                }.get(unset_gives(key), f"make wrong: set {key} in {user.name})")
            return f"  {by.name}:{by.line_for(key, text)}: {key}: {text}{note}"
        if best is None:
            return f"  {user.name}:{user.line_for(key, text)}: {key}: {text}{note}"
        return f"  {best[1]}:{best[2]}: {key}: {text}{note}"

    return ConfigError("\n".join(where(line) for line in str(exc).split("\n")))
