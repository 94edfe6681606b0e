"""Which config a results folder holds, so two configs never overwrite each other unnoticed.

Snakemake reruns a job when the config sections it depends on change (the `fp` params), and
overwrites that job's outputs: editing a config, or pointing a second config at the same
`results_dir`, replaces finished results. The identity of the effective config (the validated
`Config`, defaults filled in) is written to `<results_dir>/config-identity.json` when a real run
starts (Snakemake's `onstart`, never in a dry run); the next invocation compares its own config
with it before any job is scheduled and names the sections that differ. A real run with a
different config is refused unless `DPADAPTER_ALLOW_OVERWRITE=1` is set (docs/experiments.md).

The same short hash names the MLflow runs (`dpadapter.job`), so runs of different configs
can be told apart in the UI. Written by hand: neither Snakemake nor MLflow records which config
produced a results folder.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

from dpadapter.ground import atomic
from dpadapter.settings import Config

IDENTITY_FILE = "config-identity.json"
OVERWRITE_ENV = "DPADAPTER_ALLOW_OVERWRITE"
# Config fields that change where results go or where jobs run, not what the results are.
_NOT_IDENTITY = ("results_dir", "tracking", "device")
# Dataclass fields whose config key has another name.
_SECTION_OF = {
    "upstreams": "pretrain",
    "upstream_params": "pretrain",
    "external_upstreams": "pretrain",
}


def sections(cfg: Config) -> dict[str, Any]:
    """The effective config by top-level config key, as JSON-able data."""
    out: dict[str, Any] = {}
    for name, value in cfg.to_dict().items():
        if name in _NOT_IDENTITY:
            continue
        key = _SECTION_OF.get(name, name)
        if key != name:
            out.setdefault(key, {})[name] = value
        else:
            out[key] = value
    return json.loads(json.dumps(out, sort_keys=True, default=str))


def config_hash(cfg: Config) -> str:
    return hashlib.sha256(json.dumps(sections(cfg), sort_keys=True).encode()).hexdigest()[:16]


def run_prefix(cfg: Config) -> str:
    """`<results folder name>@<8 hex of the config hash>`: the MLflow run-name prefix."""
    return f"{Path(cfg.results_dir).name}@{config_hash(cfg)[:8]}"


def identity_path(results_dir: str | Path) -> Path:
    return Path(results_dir) / IDENTITY_FILE


def read(results_dir: str | Path) -> dict | None:
    p = identity_path(results_dir)
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return None


def _leaves(d: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(d, dict):
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(_leaves(v, f"{prefix}{k}."))
        return out
    return {prefix.rstrip("."): d}


def _defaults(obj: Any, prefix: str = "") -> set[str]:
    """Keys (as `_leaves` names them) whose value is their dataclass field's default."""
    out: set[str] = set()
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            top = not prefix and f.name in _SECTION_OF  # e.g. upstreams: pretrain.upstreams
            name = f"{_SECTION_OF[f.name]}.{f.name}" if top else f.name
            if f.default is not dataclasses.MISSING:
                default = f.default
            elif f.default_factory is not dataclasses.MISSING:
                default = f.default_factory()
            else:
                default = dataclasses.MISSING
            if default is not dataclasses.MISSING and value == default:
                out.add(prefix + name)
            out |= _defaults(value, f"{prefix}{name}.")
    elif isinstance(obj, dict):
        for k, v in obj.items():
            out |= _defaults(v, f"{prefix}{k}.")
    elif isinstance(obj, list | tuple):
        for i, v in enumerate(obj):
            out |= _defaults(v, f"{prefix}{i}.")
    return out


def _same_but_new_defaults(key: str, old: Any, new: Any, at_default: set[str]) -> bool:
    """A list of records (e.g. reference.cells) whose records only gained fields at default."""
    if not (isinstance(old, list) and isinstance(new, list) and len(old) == len(new)):
        return False
    for i, (o, n) in enumerate(zip(old, new, strict=True)):
        if not (isinstance(o, dict) and isinstance(n, dict)):
            return False
        kept = {f: v for f, v in n.items() if f in o or f"{key}.{i}.{f}" not in at_default}
        if kept != o:
            return False
    return True


# Keys that only say which jobs exist: growing or shrinking them adds or leaves out jobs and
# overwrites none (each job's own settings are in its rerun trigger,
# dpadapter.workflow.fingerprint).
_GRID_KEYS = (
    "pretrain.upstreams",
    "finetune.algorithms",
    "finetune.epsilons",
    "finetune.seeds",
    "finetune.upstreams",
    "finetune.extra_grids",
    "finetune.strategies",
    "hpo.seeds",
    *(f"audit.{k}" for k in ("algorithms", "epsilons", "federated")),
    *(f"federated.{k}" for k in ("upstreams", "strategies", "mechanisms", "seeds", "sweep_seeds")),
)
# Dicts of named entries (a task, an algorithm's or a method's params, an external backbone): an
# entry added or removed is the grid growing or shrinking; an entry's settings changing is not.
_ENTRY_DICTS = (
    "tasks",
    "finetune.algo_params",
    "finetune.recipes",
    "pretrain.upstream_params",
    "pretrain.external_upstreams",
)


def _grid_only(key: str, lo: dict, ln: dict) -> bool:
    """Whether `key` differs only because the grid grew or shrank."""
    if any(key == g or key.startswith(g + ".") for g in _GRID_KEYS):
        return True
    for d in _ENTRY_DICTS:
        if key.startswith(d + "."):
            entry = d + "." + key[len(d) + 1 :].split(".", 1)[0]
            in_old = any(k == entry or k.startswith(entry + ".") for k in lo)
            in_new = any(k == entry or k.startswith(entry + ".") for k in ln)
            return in_old != in_new
    return False


def _changed(stored: dict, cfg: Config) -> list[str]:
    """Keys whose values differ, but for an option the stored identity predates: a key the
    code added since, at its default (defaults keep what older code did), is no change; nor
    is the grid growing or shrinking (`_GRID_KEYS`, an entry added to `_ENTRY_DICTS`)."""
    lo, ln = _leaves(stored.get("sections", {})), _leaves(sections(cfg))
    missing = "(unset)"
    keys = [
        k
        for k in set(lo) | set(ln)
        if lo.get(k, missing) != ln.get(k, missing) and not _grid_only(k, lo, ln)
    ]
    at_default = _defaults(cfg)
    return sorted(
        k
        for k in keys
        if (k in lo or k not in at_default)
        and not (k in lo and k in ln and _same_but_new_defaults(k, lo[k], ln[k], at_default))
    )


def differences(stored: dict, cfg: Config) -> tuple[list[str], list[str]]:
    """(top-level sections that differ, up to 6 `key: old -> new` lines)."""
    lo, ln = _leaves(stored.get("sections", {})), _leaves(sections(cfg))
    missing = "(unset)"
    keys = _changed(stored, cfg)
    names = sorted({k.split(".")[0] for k in keys})
    lines = [f"{k}: {lo.get(k, missing)!r} -> {ln.get(k, missing)!r}" for k in keys[:6]]
    if len(keys) > 6:
        lines.append(f"... and {len(keys) - 6} more")
    return names, lines


def check(cfg: Config) -> str | None:
    """A warning when `cfg.results_dir` holds results of another config, else None."""
    stored = read(cfg.results_dir)
    if stored is None or stored.get("hash") == config_hash(cfg) or not _changed(stored, cfg):
        return None
    names, lines = differences(stored, cfg)
    folder = cfg.results_dir
    detail = "".join(f"\n    {line}" for line in lines)
    return (
        f"{folder}/ holds results of another config (config {stored.get('hash', '?')[:8]}, "
        f"written {stored.get('written', '?')}; this config is {config_hash(cfg)[:8]}).\n"
        f"  Sections that differ: {', '.join(names) or '(none)'}{detail}\n"
        "  Running it re-runs every job those sections affect and overwrites its results "
        "(a job that fails gets its previous ones back).\n"
        f"  To keep both, give this config its own folder: `results_dir: {folder}-<name>` in it "
        f"(or `--config results_dir={folder}-<name>`).\n"
        f"  To replace them on purpose, run with {OVERWRITE_ENV}=1."
    )


def fingerprint_version(cfg: Config) -> int:
    """The rerun-trigger version of `cfg.results_dir` (dpadapter.workflow.fingerprint): what its
    identity records, else 1 for a folder that already holds results (built by older code),
    else the current one (a new folder)."""
    from dpadapter.workflow.fingerprint import CURRENT_VERSION

    stored = read(cfg.results_dir)
    if stored is not None:
        return int(stored.get("fingerprints", 1))
    finetune = Path(cfg.results_dir) / "finetune"
    return 1 if finetune.is_dir() and any(finetune.rglob("metrics.json")) else CURRENT_VERSION


# What a version 1 folder's fine-tuning triggers read instead of the config (`fingerprint_pins`).
PINS_KEY = "fingerprint_pins"


def fingerprint_pins(cfg: Config) -> dict[str, Any] | None:
    """For a version 1 folder, the `finetune.upstreams` its finished jobs were built with
    (dpadapter.workflow.fingerprint.PINNED_UPSTREAMS; {} when it was unset), else None.

    Version 1 triggers hold the list, so the config's own list would rerun every finished job
    as soon as an upstream is added. The list is pinned when code that knows about pins first
    sees the folder: from its identity, which holds the config of its last run (an empty list
    there is the key unset: the effective config fills no default in), or, for a folder older
    than identities, from this config. `record` keeps it from then on."""
    from dpadapter.workflow.fingerprint import PINNED_UPSTREAMS

    if fingerprint_version(cfg) >= 2:
        return None
    stored = read(cfg.results_dir)
    if stored is not None and PINS_KEY in stored:
        return dict(stored[PINS_KEY])
    if stored is not None:
        built = stored.get("sections", {}).get("finetune", {}).get("upstreams")
    else:
        built = list(cfg.finetune.upstreams)
    return {PINNED_UPSTREAMS: list(built)} if built else {}


def overwrite_allowed() -> bool:
    return os.environ.get(OVERWRITE_ENV, "").strip().lower() in {"1", "true", "yes"}


# The content fingerprint of each dataset as the folder's last run read it.
DATA_KEY = "data"
# A folder begun before data triggers (fingerprint version < 3): the datasets its finished jobs
# were built from, which keep triggers without data (`untriggered_data`).
UNTRIGGERED_KEY = "data_untriggered"


def _datasets(secs: dict[str, Any]) -> set[str]:
    roles = [secs.get("public") or {}, *(secs.get("tasks") or {}).values()]
    return {r["dataset"] for r in roles if isinstance(r, dict) and r.get("dataset")}


def untriggered_data(cfg: Config) -> set[str]:
    """Datasets whose content is left out of the rerun triggers in this folder.

    None in a folder begun with data triggers (version 3). In an older folder, the datasets its
    finished jobs were built from: putting their content in those jobs' triggers now would rerun
    every one of them. A dataset the folder sees first after the upgrade (a researcher's own
    folder added as a task) gets triggers there too. Read from the identity of the folder's last
    run (the datasets of its config), or for a folder older than identities, this config's; kept
    from then on (`record`)."""
    from dpadapter.workflow.fingerprint import DATA_VERSION

    if fingerprint_version(cfg) >= DATA_VERSION:
        return set()
    stored = read(cfg.results_dir)
    if stored is not None and UNTRIGGERED_KEY in stored:
        return set(stored[UNTRIGGERED_KEY])
    return _datasets(stored.get("sections", {}) if stored is not None else sections(cfg))


def data_changes(cfg: Config, data: dict[str, str | None]) -> str | None:
    """Which datasets' content differs from what the folder's last run read (`record`), so
    `snakemake -n` says why their jobs rerun; None when none does or nothing is recorded."""
    stored = (read(cfg.results_dir) or {}).get(DATA_KEY)
    if not stored:
        return None
    changed = [n for n, fp in sorted(data.items()) if n in stored and stored[n] != fp and fp]
    if not changed:
        return None
    lines = "".join(
        f"\n    {n}: content {str(stored[n])[:12]} -> {str(data[n])[:12]}" for n in changed
    )
    return (
        f"the data changed since the last run in {cfg.results_dir}/:{lines}\n"
        "  Every job that reads it reruns (its `fp` param holds the data's content fingerprint; "
        "`snakemake --list-changes params` lists them)."
    )


def record(cfg: Config, data: dict[str, str | None] | None = None) -> Path:
    """Write the identity of `cfg` into its results folder (atomically); keep earlier hashes,
    and `data`, the content fingerprint of each dataset this run reads (`data_changes`)."""
    p = identity_path(cfg.results_dir)
    stored = read(cfg.results_dir) or {}
    h = config_hash(cfg)
    previous = list(stored.get("previous", []))
    if stored.get("hash") and stored["hash"] != h:
        previous.append({"hash": stored["hash"], "written": stored.get("written")})
    pins = fingerprint_pins(cfg)  # before this write, as the version
    from dpadapter.workflow.fingerprint import DATA_VERSION

    old_folder = fingerprint_version(cfg) < DATA_VERSION
    payload = {
        **({UNTRIGGERED_KEY: sorted(untriggered_data(cfg))} if old_folder else {}),
        **({PINS_KEY: pins} if pins is not None else {}),
        "fingerprints": fingerprint_version(cfg),  # before this write: a new folder's is current
        "hash": h,
        "written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "previous": previous,
        "sections": sections(cfg),
        **({DATA_KEY: {**stored.get(DATA_KEY, {}), **data}} if data else {}),
    }
    atomic.write_text(p, json.dumps(payload, indent=1, sort_keys=True) + "\n")
    return p


class RefusedOverwrite(SystemExit):
    """A real run would overwrite another config's results: said as a message, not a traceback
    (Snakemake prints a SystemExit's text as it is)."""


def before_run(cfg: Config, data: dict[str, str | None] | None = None) -> None:
    """Snakemake `onstart`: refuse to overwrite another config's results, else record ours."""
    message = check(cfg)
    if message is not None and not overwrite_allowed():
        raise RefusedOverwrite("refusing to run: " + message)
    record(cfg, data)
