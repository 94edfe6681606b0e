"""Upstream variants: a registered method with some params overridden, named in the path.

`dpadapter+gamma=0.5` is DPAdapter with gamma 0.5 on top of its config params. Sweeps use such
names as the `{upstream}` wildcard, so a swept checkpoint flows through the same `pretrain` and
`finetune` rules (and output layout) as the main grid, and each is computed once.
"""

from __future__ import annotations

import re
from typing import Any

VARIANT_RE = r"[a-z0-9-]+(\+[a-z0-9_]+=[0-9.eE+-]+)*"


def parse_variant(name: str) -> tuple[str, dict[str, Any]]:
    if not re.fullmatch(VARIANT_RE, name):
        raise ValueError(f"bad upstream name {name!r}: expected method[+param=number]...")
    method, *parts = name.split("+")
    overrides: dict[str, Any] = {}
    for part in parts:
        key, value = part.split("=", 1)
        overrides[key] = int(value) if re.fullmatch(r"-?[0-9]+", value) else float(value)
    return method, overrides


def format_variant(method: str, **overrides: Any) -> str:
    return "+".join([method, *(f"{k}={v:g}" for k, v in sorted(overrides.items()))])
