"""What the workflow's parse and the config validation read of the registries, without torch.

The registries stay the one home of each method's, algorithm's and model's facts (the classes'
`params_schema`, their flags); importing them imports torch and Opacus (~2.5 s). The config
validation and the rule files only need names, params schemas and a few flags, so those are
read from `catalog.json` beside this file, a manifest derived from the live registries by
`python -m dpadapter.registries.catalog --write`.

Correctness does not depend on remembering to regenerate it: the manifest records the sha256
of the sources it was derived from (`SOURCES`); when that does not match the files on disk,
the live registries are imported instead (slow but right) and a warning, once a process, says
how to regenerate. `tests/registries/test_catalog.py` fails on a manifest that differs from the live
registries, so a stale one never lands.

What the manifest holds, per registry:
- `algorithms`: each DP algorithm's `params_schema`;
- `upstreams`: each upstream method's `params_schema`, `needs_warmup`, and `sgd_schedule`
  (whether it has an SGD schedule, `sgd_config`, that `control` can match);
- `models`: the registered pipeline models' names.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_PACKAGE = Path(__file__).resolve().parents[1]
MANIFEST = Path(__file__).resolve().parent / "catalog.json"
# What the manifest is derived from (paths under src/dpadapter; folders: every .py in them).
SOURCES = (
    "algorithms",
    "upstream",
    "models",
    "ground/param_schema.py",
    "registries/catalog.py",
)
WRITE_COMMAND = "python -m dpadapter.registries.catalog --write"


@dataclass(frozen=True)
class Algorithm:
    name: str
    params_schema: dict[str, Any]
    distributed_refusal: str | None = None  # why finetune.processes > 1 cannot run it
    # reads per-example gradients itself (GEP): runs Opacus' hooks under bk, never compiled
    needs_per_sample_gradients: bool = False


@dataclass(frozen=True)
class Upstream:
    name: str
    params_schema: dict[str, Any]
    needs_warmup: bool
    sgd_schedule: bool


def algorithms() -> dict[str, Algorithm]:
    """Registered DP algorithms by name, in registry order."""
    return {
        n: Algorithm(
            n,
            e["params_schema"],
            e.get("distributed_refusal"),
            bool(e.get("needs_per_sample_gradients")),
        )
        for n, e in _manifest()["algorithms"].items()
    }


def upstreams() -> dict[str, Upstream]:
    """Registered upstream methods by name, in registry order."""
    return {
        n: Upstream(n, e["params_schema"], e["needs_warmup"], e["sgd_schedule"])
        for n, e in _manifest()["upstreams"].items()
    }


def models() -> tuple[str, ...]:
    """Registered pipeline models' names (not `timm:<name>`)."""
    return tuple(_manifest()["models"])


def sources_digest() -> str | None:
    """sha256 of the files in `SOURCES` (names and bytes); None when one is missing."""
    h = hashlib.sha256()
    for rel in SOURCES:
        path = _PACKAGE / rel
        files = sorted(path.rglob("*.py")) if path.is_dir() else [path]
        for f in files:
            if not f.is_file():
                return None
            h.update(f.relative_to(_PACKAGE).as_posix().encode() + b"\0")
            h.update(f.read_bytes() + b"\0")
    return h.hexdigest()


@functools.cache
def _manifest() -> dict[str, Any]:
    digest = sources_digest()
    try:
        stored = json.loads(MANIFEST.read_text())
    except (OSError, ValueError):
        stored = None
    if digest is not None and stored is not None and stored.get("sources_sha256") == digest:
        return stored
    warnings.warn(
        f"{MANIFEST} does not match the registries' sources (it is missing or stale), so the "
        f"registries were imported (slow); regenerate it with `{WRITE_COMMAND}`",
        stacklevel=3,
    )
    return build()


def build() -> dict[str, Any]:
    """The manifest from the live registries (imports torch, Opacus and every method)."""
    from dpadapter.algorithms import ALGORITHMS
    from dpadapter.models import MODEL_NAMES
    from dpadapter.upstream import UPSTREAMS

    manifest = {
        "sources_sha256": sources_digest(),
        "algorithms": {
            n: {
                "params_schema": c.params_schema,
                "distributed_refusal": c.distributed_refusal,
                "needs_per_sample_gradients": bool(c.needs_per_sample_gradients),
            }
            for n, c in ALGORITHMS.items()
        },
        "upstreams": {
            n: {
                "params_schema": c.params_schema,
                "needs_warmup": bool(c.needs_warmup),
                "sgd_schedule": hasattr(c, "sgd_config"),
            }
            for n, c in UPSTREAMS.items()
        },
        "models": list(MODEL_NAMES),
    }
    return json.loads(json.dumps(manifest))  # as read back from the file (lists, not tuples)


def write(path: Path = MANIFEST) -> None:
    path.write_text(json.dumps(build(), indent=1) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m dpadapter.registries.catalog", description=__doc__
    )
    parser.add_argument("--write", action="store_true", help=f"rewrite {MANIFEST.name}")
    args = parser.parse_args(argv)
    if args.write:
        write()
        print(f"wrote {MANIFEST}")
    else:
        fresh = json.loads(MANIFEST.read_text()) == build() if MANIFEST.is_file() else False
        print(f"{MANIFEST}: {'up to date' if fresh else 'stale: run ' + WRITE_COMMAND}")
        raise SystemExit(0 if fresh else 1)


if __name__ == "__main__":
    main()
