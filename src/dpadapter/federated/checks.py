"""The federated stage's own checks of a config: the task and upstreams its `federated`
section names, then what the section tells alone (`FederatedConfig.problems`).

Each problem is a `key: text` line; `dpadapter.validation.compose` composes them, and they stop only
`make federated` (`dpadapter.settings.problems.OPTIONAL`).
"""

from __future__ import annotations

from dpadapter.settings import Config
from dpadapter.settings.errors import NOT_METHOD, missing


def problems(cfg: Config) -> list[str]:
    """Cross-field checks of the `federated` section (names resolved against the config)."""
    f, out = cfg.federated, []
    if f.task is not None and f.task not in cfg.tasks:
        out.append(f"federated.task: unknown task {f.task!r}; known: {sorted(cfg.tasks)}")
    out += missing("federated.upstreams", f.upstreams, cfg.upstreams, NOT_METHOD)
    if "scratch" in f.strategies and "scratch" not in cfg.upstreams:
        out.append("federated.strategies: 'scratch' needs 'scratch' in pretrain.methods")
    if any(s != "scratch" for s in f.strategies) and not f.pretrained(cfg.upstreams):
        out.append("federated.upstreams: no pre-trained upstream for ht/ft/ut")
    return out + f.problems()
