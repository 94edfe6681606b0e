"""The one home of a job grid's expansion: every combination of some axes, each once.

The fine-tuning grid (`Config.finetune_grid`), the federated grid (`FederatedConfig.jobs`),
the HPO's (`dpadapter.hpo.jobs`, `dpadapter.hpo.probe_pairs`), the audit's
(`dpadapter.audit.stage.audit_jobs`) and the gamma sweeps' (`workflow/rules/sweeps.smk`) are
each a union of such products; they all expand through `grid`, so the order jobs are listed in
(first axis slowest, the order the config writes them) and the rule that a job is listed once
are the same everywhere.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import Any


def grid(*axes: Iterable[Any]) -> list[tuple[Any, ...]]:
    """Every tuple of one value per axis, the first axis varying slowest, without duplicates
    (the first occurrence keeps its place)."""
    return list(dict.fromkeys(itertools.product(*axes)))


def union(*grids: Iterable[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """The jobs of several grids in order, each once."""
    return list(dict.fromkeys(itertools.chain(*grids)))
