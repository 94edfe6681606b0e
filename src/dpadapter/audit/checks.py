"""The audit's own checks of a config: its `audit` section against the algorithm registry and
the tasks, then what the section tells alone (`AuditConfig.problems`).

Each problem is a `key: text` line; `dpadapter.validation.compose` composes them, and they stop only
`make audit` (`dpadapter.settings.problems.OPTIONAL`); the audit's entry point refuses them too
(`check`).
"""

from __future__ import annotations

from dpadapter.registries import catalog
from dpadapter.settings import Config
from dpadapter.settings.errors import invalid

# The audit's names of the federated mechanisms it audits (`audit.federated`).
FEDERATED_PREFIX = "federated-"


def problems(cfg: Config) -> list[str]:
    """Cross-field checks of the `audit` section, against the registry and the tasks."""
    a, out, known = cfg.audit, [], catalog.algorithms()
    for name in a.algorithms:
        if name not in known:
            out.append(f"audit.algorithms: unknown algorithm {name!r}; known: {sorted(known)}")
    if a.task is not None and a.task not in cfg.tasks:
        out.append(f"audit.task: unknown task {a.task!r}; known: {sorted(cfg.tasks)}")
    for name in known:
        if name.startswith(FEDERATED_PREFIX):
            out.append(f"algorithm {name!r}: the prefix {FEDERATED_PREFIX!r} is the audit's")
    return out + a.problems()


def check(cfg: Config) -> None:
    """Raise the audit's problems, if any, as one ConfigError."""
    found = problems(cfg)
    if found:
        raise invalid(found)
