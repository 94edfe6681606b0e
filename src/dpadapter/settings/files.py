"""The config files: reading one, the overlay language (`base:`, `unset:`), merging, and
refusing a key written twice.

What already does the job, and why the rest is kept (weighed against issue 38):

- Merging is Snakemake's rule. Snakemake merges several `--configfile`s and `--config` in
  order, mappings key by key, anything else replaced: `merge` is that rule, and `read_files`
  replays it for what does not run under Snakemake (the CLI, a job, the tests), so the two
  never disagree; `common.smk` reads the `--configfile`s Snakemake was given through it only
  when one of them is an overlay.
- A file naming its own base (`base: ../config.yaml`) is kept because the project's shipped
  experiments are each one file (`configs/*.yaml`, named once by `make run CONFIG=...`, by
  dvc.yaml's stage commands and by `python -m dpadapter --config`): the chain travels with
  the file instead of with every command line that names it, and a missing or cyclic base is
  refused at the `base:` line. `unset:` is kept because no Snakemake merge can remove a key
  (a `null` is a value: `pretrain.params.sam: null` fails the schema instead of dropping the
  method's params).
- OmegaConf (with Hydra's defaults lists for composition) merges in order and its loader
  refuses a duplicate key too (omry/omegaconf#257). It is not used because what this project
  needs most from the file layer it does not give: the file and line a merged value comes
  from (`key_origins`), which every error message is pointed with (`dpadapter.settings.lines`,
  `dpadapter.settings.problems`); its merged config is a `DictConfig`, not the plain mapping that
  Snakemake's `config`, the JSON schema and the rerun fingerprints
  (`dpadapter.workflow.fingerprint`)
  read; removing a key is Hydra's command-line override (`~key`), not something a file says;
  and it would be one more import in the workflow's parse, which is kept light
  (tests/workflow/test_light_parse.py).
- Duplicate keys: PyYAML, like Snakemake's loader, keeps the later of two equal keys without a
  word (`epsilons:` written twice would run a grid nobody asked for); `key_lines` refuses them,
  naming both lines, and JSON objects are read with a hook that refuses them.

What is kept is the `base:` chain, `unset:`, the duplicate-key refusal and the line maps
(`dpadapter.settings.lines`); the merging rule is Snakemake's.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import os
from pathlib import Path
from typing import Any

import yaml

from dpadapter.ground import atomic
from dpadapter.settings.errors import ConfigError
from dpadapter.settings.task_refs import drop_task_references


def shown_path(path: str | Path) -> str:
    """`path` as a person typed it: relative to the working directory when it lies below it."""
    p = Path(os.path.normpath(Path(path).absolute()))  # configs/../config.yaml: config.yaml
    try:
        return str(p.relative_to(Path.cwd()))
    except ValueError:
        return str(p)


# libyaml's parser where PyYAML has it (its wheels do): the same nodes and marks as the
# pure-Python parser, several times faster. A run reads the same few config files many times
# (every job, the workflow's parse, the checks) and the tests thousands of times, so a text's
# parse is memoised: a pure function of the text (an edited file is another text), with
# copies handed out.
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


@functools.lru_cache(maxsize=128)
def _parsed(text: str) -> tuple[dict[str, int], tuple[str, int, int] | None, Any]:
    """(line of every key path, the first duplicate key as (path, line, first line) or None,
    the document), from one parse of `text`."""
    loader = _LOADER(text)
    try:
        root = loader.get_single_node()
        data = loader.construct_document(root) if root is not None else None
    finally:
        loader.dispose()
    lines: dict[str, int] = {}
    duplicate = None
    pending = [(root, "")]
    while pending and duplicate is None:
        node, where = pending.pop()
        if isinstance(node, yaml.MappingNode):
            first: dict[str, int] = {}
            for key, value in node.value:
                name = str(key.value)
                here = f"{where}.{name}" if where else name
                line = key.start_mark.line + 1
                if name in first:
                    duplicate = (here, line, first[name])
                    break
                first[name] = lines[here] = line
                pending.append((value, here))
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                here = f"{where}.{i}" if where else str(i)
                lines[here] = item.start_mark.line + 1
                pending.append((item, here))
    return lines, duplicate, data


def _read_yaml(p: Path) -> tuple[dict[str, int], Any]:
    """The line map and a fresh copy of the document of `p`; a duplicate key refused."""
    lines, duplicate, data = _parsed(p.read_text())
    if duplicate is not None:
        here, line, first = duplicate
        raise ConfigError(
            f"invalid config:\n  {shown_path(p)}:{line}: {here}: duplicate key "
            f"(first at line {first}); YAML would keep only the later "
            "value: delete one of the two"
        )
    return dict(lines), copy.deepcopy(data)


def key_lines(path: str | Path) -> dict[str, int]:
    """Line (1-based) of every key and list item of a YAML (or JSON) file, by dotted path.

    PyYAML, like Snakemake's loader, keeps the later of two equal keys without a word, so
    `epsilons:` written twice would run a grid nobody asked for: a key given twice in one
    mapping raises ConfigError naming both lines. Paths are spelt as the schema errors spell
    them (`finetune.extra_grids.0.algorithms`), so a problem can be pointed at its line.
    """
    return _read_yaml(Path(path))[0]


def _unique(path: Path, pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object, refused when it names a key twice (json keeps the later one silently)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ConfigError(f"invalid config:\n  {shown_path(path)}: {key}: duplicate key")
        out[key] = value
    return out


def read_one(p: Path) -> dict[str, Any]:
    """One file as a plain mapping, `base:` and `unset:` still in it; duplicates refused."""
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    try:
        # JSON first: PyYAML reads JSON's 1e-05 as a string (YAML 1.1 floats need a dot).
        if p.suffix == ".json":
            raw = json.loads(p.read_text(), object_pairs_hook=functools.partial(_unique, p))
        else:
            raw = _read_yaml(p)[1] or {}
    except (yaml.YAMLError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{p}: not valid YAML: {exc}") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"{p}: the config must be a mapping of sections")
    return raw


# Top-level keys of an overlay file, consumed while merging (the schema never sees them).
BASE_KEY = "base"
UNSET_KEY = "unset"


def _line(p: Path, key: str) -> str:
    """`file:line` of `key` in `p` (just `file` where the line cannot be had, e.g. JSON)."""
    with contextlib.suppress(OSError, yaml.YAMLError, ConfigError):
        line = key_lines(p).get(key)
        if line is not None:
            return f"{shown_path(p)}:{line}"
    return shown_path(p)


def config_chain(path: str | Path) -> list[Path]:
    """The files `path` is made of, its furthest `base:` first and `path` itself last.

    A base path is relative to the folder of the file that names it. A base that is missing,
    not a string, or that leads back to a file already in the chain is refused, naming the file
    and line of the `base:` key.
    """
    chain = [Path(path)]
    seen = [Path(path).resolve()]
    while True:
        here = chain[0]
        raw = read_one(here)
        base = raw.get(BASE_KEY)
        if base is None:
            return chain
        where = _line(here, BASE_KEY)
        if not isinstance(base, str) or not base.strip():
            raise ConfigError(
                f"invalid config:\n  {where}: base: must be the path of another config file "
                f"(relative to {shown_path(here.parent)}/), not {base!r}"
            )
        target = here.parent / base
        if not target.is_file():
            raise ConfigError(
                f"invalid config:\n  {where}: base: {base!r} not found "
                f"(looked for {shown_path(target)})"
            )
        if target.resolve() in seen:
            names = " -> ".join(shown_path(f) for f in [*reversed(chain), target])
            raise ConfigError(f"invalid config:\n  {where}: base: cycle of config files: {names}")
        chain.insert(0, target)
        seen.append(target.resolve())


def uses_base(path: str | Path) -> bool:
    """Whether `path` is an overlay (has a top-level `base:` or `unset:`)."""
    return bool({BASE_KEY, UNSET_KEY} & set(read_one(Path(path))))


def merge(base: dict[str, Any], overlay: dict[str, Any]) -> dict[str, Any]:
    """`overlay` on top of `base`: mappings merge key by key, anything else replaces.

    A list replaces the base's list whole, and a `null` is a value like any other (it sets the
    key to null; removing a key is `unset:`). Neither argument is changed; key order is the
    base's, with keys new in the overlay after it.
    """
    out = copy.deepcopy(base)
    for key, value in overlay.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def unset_keys(raw: dict[str, Any], keys: Any, p: Path) -> dict[str, Any]:
    """`raw` without the dotted `keys` (an overlay's `unset:` list), each of which must exist."""
    where = _line(p, UNSET_KEY)
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise ConfigError(
            f"invalid config:\n  {where}: unset: must be a list of dotted keys of the base "
            "(e.g. [pretrain.params.sam])"
        )
    out = copy.deepcopy(raw)
    for key in keys:
        *parents, last = key.split(".")
        node: Any = out
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict) or last not in node:
            raise ConfigError(
                f"invalid config:\n  {where}: unset: {key!r} is not a key of the base config"
            )
        del node[last]
    return out


def read_chain(path: str | Path) -> dict[str, Any]:
    """The merged content of `path` and its chain of bases, without `base:` and `unset:`."""
    raw: dict[str, Any] = {}
    for p in config_chain(path):
        layer = read_one(p)
        layer.pop(BASE_KEY, None)
        if UNSET_KEY in layer:
            before = set(raw.get("tasks") or {})
            raw = unset_keys(raw, layer.pop(UNSET_KEY), p)
            # the base's keys naming the tasks it removed go with them (settings.task_refs)
            raw = drop_task_references(raw, before - set(raw.get("tasks") or {}))
        raw = merge(raw, layer)
    return raw


def read_raw(path: str | Path, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The config file as a plain mapping (not validated), with top-level `overrides` applied.

    A file with `base:` is merged onto its base first (`read_chain`). A key written twice in
    any file of the chain is refused (`key_lines`).
    """
    return {**read_chain(path), **(overrides or {})}


def read_files(files: list[str | Path], overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """What Snakemake's `config` is for `--configfile files... --config overrides`, bases merged.

    Snakemake merges its config files and `--config` recursively (mappings key by key), the
    same rule as `merge`; it does not know `base:`, so the workflow rebuilds its `config` with
    this when a file is an overlay (`workflow/rules/common.smk`).
    """
    raw: dict[str, Any] = {}
    for f in files:
        raw = merge(raw, read_chain(f))
    return merge(raw, dict(overrides or {}))


MERGED_FILE = "config.merged.yaml"


def write_merged(raw: dict[str, Any], results_dir: str | Path, files: list[str | Path]) -> Path:
    """Write the effective config `raw` as `<results_dir>/config.merged.yaml` (atomically).

    An overlay names only what differs from its base; this file is the whole config the run
    used, after every `base:` and `--config`, so the results can be read (or rerun) without
    the chain of files. Written when a real run starts, never in a dry run.
    """
    out = Path(results_dir) / MERGED_FILE
    out.parent.mkdir(parents=True, exist_ok=True)
    plain = json.loads(json.dumps(raw, default=str))  # Snakemake's JSON loader: OrderedDicts
    sources = ", ".join(shown_path(f) for f in files) or "(none)"
    text = (
        f"# The effective config of {shown_path(results_dir)}/: {sources} with every base: "
        "merged in\n# and --config applied. Written by the workflow when a run starts; "
        "do not edit.\n" + yaml.safe_dump(plain, sort_keys=False, allow_unicode=True)
    )
    atomic.write_text(out, text)
    return out
