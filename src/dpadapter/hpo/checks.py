"""The HPO's own checks of a config: the names its `hpo` section reads from the rest of the
config and the registry, then what the section tells alone (`HPOConfig.problems`).

Each problem is a `key: text` line; `dpadapter.validation.compose` composes them, and they stop only
`make hpo` (`dpadapter.settings.problems.OPTIONAL`).
"""

from __future__ import annotations

from dpadapter.registries import catalog
from dpadapter.settings import Config
from dpadapter.settings.errors import NOT_METHOD, missing


def problems(cfg: Config) -> list[str]:
    """Cross-field checks of the `hpo` section (names, ranges, and a budget the trials fit in)."""
    h, out, algos = cfg.hpo, [], catalog.algorithms()
    out += missing("hpo.upstreams", h.upstreams, cfg.upstreams, NOT_METHOD)
    out += missing("hpo.tasks", h.tasks, cfg.tasks, "unknown task {}")
    known = f"unknown algorithm {{}}; known: {sorted(algos)}"
    out += missing("hpo.algorithms", h.algorithms, algos, known)
    return out + h.problems()
