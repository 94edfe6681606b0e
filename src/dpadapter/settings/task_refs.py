"""What an overlay's `unset:` of the base's tasks takes with it: the base's keys naming them.

A researcher's overlay replaces the default's tasks with their own (`unset: [tasks]`, then
`tasks:`; docs/your-data.md). The default names its tasks in other sections too (an extra grid,
the sweeps, the HPO, the federated and audit runs, a reference table): left in place, those keys
name tasks that no longer exist, so the main grid is refused and every run warns about sections
it does not use. The base's mentions of the removed tasks are dropped with them: a list loses
those names (and falls to its default, all tasks, when none is left), a grid or params entry
for them only goes, a key naming one of them falls to its default (the first task), a reference
table about one goes. What the overlay itself writes is merged after, untouched.
"""

from __future__ import annotations

import copy
from typing import Any

# Lists of task names, and single task names (dotted keys).
_NAME_LISTS = ("sweeps.tasks", "hpo.tasks")
_NAMES = ("federated.task", "audit.task")
# Lists of entries with their own `tasks` list (an empty one means every task).
_ENTRY_LISTS = ("finetune.extra_grids", "finetune.algo_params_for")


def _parent(raw: dict[str, Any], dotted: str) -> tuple[dict[str, Any] | None, str]:
    *path, last = dotted.split(".")
    node: Any = raw
    for part in path:
        node = node.get(part) if isinstance(node, dict) else None
    return (node if isinstance(node, dict) else None), last


def drop_task_references(raw: dict[str, Any], removed: set[str]) -> dict[str, Any]:
    """`raw` without its mentions of the `removed` task names (module docstring)."""
    if not removed:
        return raw
    out = copy.deepcopy(raw)
    for key in _NAME_LISTS:
        node, last = _parent(out, key)
        if node is not None and isinstance(node.get(last), list):
            kept = [t for t in node[last] if t not in removed]
            if kept:
                node[last] = kept
            else:
                del node[last]
    for key in _NAMES:
        node, last = _parent(out, key)
        if node is not None and node.get(last) in removed:
            del node[last]
    for key in _ENTRY_LISTS:
        node, last = _parent(out, key)
        if node is None or not isinstance(node.get(last), list):
            continue
        entries = []
        for e in node[last]:
            tasks = e.get("tasks") if isinstance(e, dict) else None
            if isinstance(tasks, list) and tasks and set(tasks) <= removed:
                continue  # an entry about removed tasks only
            if isinstance(tasks, list) and set(tasks) & removed:
                e = {**e, "tasks": [t for t in tasks if t not in removed]}
            entries.append(e)
        if entries:
            node[last] = entries
        else:
            del node[last]
    ref = out.get("reference")
    if isinstance(ref, dict) and ref.get("task") in removed:
        del out["reference"]
    elif isinstance(ref, dict) and isinstance(ref.get("cells"), list):
        ref["cells"] = [
            c for c in ref["cells"] if not (isinstance(c, dict) and c.get("task") in removed)
        ]
    return out
