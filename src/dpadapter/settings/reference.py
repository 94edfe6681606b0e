"""The `reference` section: a published table the report shows beside ours
(`dpadapter.stages.reference`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ReferenceCell:
    algorithm: str
    epsilon: float
    mean: float  # test accuracy %, as published
    std: float = 0.0
    # A table with several models or datasets (DP-SAT Table 3): this cell's own upstream and
    # task; None = the reference's.
    upstream: str | None = None
    task: str | None = None


@dataclass(frozen=True)
class ReferenceConfig:
    """A published table to reproduce: its cells, and which of our runs they compare with."""

    name: str
    source: str
    upstream: str
    task: str
    cells: tuple[ReferenceCell, ...]
    baseline: str = "dpsgd"  # ERR = error-rate reduction of `improved` over `baseline`
    improved: str = "dpsat"
    notes: str = ""


def parse_reference(d: dict[str, Any] | None) -> ReferenceConfig | None:
    """The `reference` section of a raw config (None: no published table)."""
    if not d:
        return None
    cells = tuple(ReferenceCell(**c) for c in d.get("cells", ()))
    return ReferenceConfig(**{**d, "cells": cells})
