"""The import graph of src/dpadapter: layers point down, stages are never imported back, no cycle.

Read from the source (every `import`, including those inside functions: a lazy import is still
a dependency), so the test needs no torch and sees what a reader sees. Every module lives in a
folder, and each folder is one layer, low to high:

0. the ground floor: `ground` (atomic writes, device, the processes of a job, tables, plots,
   statistics, params schemas; it imports nothing of the package), `settings` (the config's
   sections, files, schema, and where a problem's fix belongs), `workflow` (what the rule
   files read while they parse: identity, rerun fingerprints and numbering, the Snakemake and
   DVC adapters),
   `tracking`, `compat`
1. privacy (accounting, calibration, ledger), models, data (its checks too)
2. per-sample gradients and clipping (`per_sample`)
3. algorithms (one DP method per file)
4. the DP and non-private training loops, the job harness and what a step trains (`train`)
5. upstream methods, federated, HPO, audit (experiments built on the loops), and `registries`
   (the catalog that reads the registries' names and schemas without torch)
6. entry points: `stages` (and the main grid's checks, `stages.checks`), `launch` (the command
   line, the fork server, the supervisor), each package's `cli`, `validation` (composes every
   feature's checks and scopes the optional sections to their targets), and `__main__`

Each feature owns its config checks (`<feature>.checks`); no feature imports another's, and only
the composers (`validation.compose`, and `validation.optional_sections`, which scopes them to a
target) read several. The package root holds only `__init__` and `__main__`, so a module's
folder says its layer, and following a name through the folders, as a reader does, never climbs
back up.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

LAYERS: dict[str, int] = {
    "dpadapter": 0,
    "dpadapter.compat": 0,
    "dpadapter.ground": 0,
    "dpadapter.settings": 0,
    "dpadapter.workflow": 0,
    "dpadapter.tracking": 0,  # its rooms too, in the order of TRACKING_ORDER below
    "dpadapter.privacy": 1,
    "dpadapter.models": 1,
    "dpadapter.data": 1,
    "dpadapter.per_sample": 2,
    "dpadapter.algorithms": 3,
    "dpadapter.train": 4,
    "dpadapter.upstream": 5,
    "dpadapter.federated": 5,
    "dpadapter.hpo": 5,
    "dpadapter.audit": 5,
    "dpadapter.registries": 5,
    "dpadapter.stages": 6,
    "dpadapter.validation": 6,
    "dpadapter.launch": 6,
    "dpadapter.__main__": 6,
}
ENTRY = 6
# The modules that compose the features' checks (`<feature>.checks`).
COMPOSERS = ("dpadapter.validation.compose", "dpadapter.validation.optional_sections")


def modules(src: Path = SRC) -> dict[str, Path]:
    out = {}
    for f in sorted(src.rglob("*.py")):
        parts = list(f.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


def import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the dpadapter modules it imports (a name imported from a package that is a
    module of its own counts as that module)."""
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, f in mods.items():
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                if node.module.split(".")[0] != "dpadapter":
                    continue
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    graph[m].add(sub if sub in mods else node.module)
            elif isinstance(node, ast.Import):
                graph[m] |= {a.name for a in node.names if a.name.split(".")[0] == "dpadapter"}
    return graph


def layer(module: str) -> int:
    """The layer of the longest registered prefix; a package's `cli` is an entry point."""
    if module.endswith(".cli"):
        return ENTRY
    parts = module.split(".")
    for k in range(len(parts), 1, -1):  # the root package's own layer is not a default
        prefix = ".".join(parts[:k])
        if prefix in LAYERS:
            return LAYERS[prefix]
    if module == "dpadapter":
        return LAYERS[module]
    raise KeyError(f"{module} is in no layer: add its package to LAYERS in {__file__}")


def folder(module: str) -> str:
    """The package folder a reader opens: `dpadapter.<first part>` (the root's own modules are
    their own folders)."""
    return ".".join(module.split(".")[:2])


def split_folders(layers: dict[str, int] = LAYERS) -> list[str]:
    """Registered packages whose layer is not their folder's: a folder that holds two layers
    (as `train/per_sample/`, layer 2 inside `train/`, layer 4, once did)."""
    return sorted(
        f"{p} (layer {n}) inside {folder(p)} (layer {layers[folder(p)]})"
        for p, n in layers.items()
        if folder(p) != p and folder(p) in layers and layers[folder(p)] != n
    )


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = {start}, [start]
    while todo:
        for t in graph.get(todo.pop(), ()):
            if t not in seen:
                seen.add(t)
                todo.append(t)
    return seen


def folder_climbs(graph: dict[str, set[str]], start: str) -> list[str]:
    """Every import reachable from `start` that leads into a folder of a higher layer than the
    folder it leaves (what a reader following a name through the folders sees as a climb)."""
    return sorted(
        f"{m} ({folder(m)}) imports {t} ({folder(t)})"
        for m in reachable(graph, start)
        for t in graph.get(m, ())
        if layer(folder(t)) > layer(folder(m))
    )


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{m} (layer {layer(m)}) imports {t} (layer {layer(t)})"
        for m, ts in graph.items()
        for t in ts
        if layer(t) > layer(m)
    )


def foreign_checks(graph: dict[str, set[str]]) -> list[str]:
    """Imports of a feature's checks module from outside that feature (the composers aside)."""
    return sorted(
        f"{m} imports {t}"
        for m, ts in graph.items()
        if m not in COMPOSERS
        for t in ts
        if t.endswith(".checks")
        and m != t.removesuffix(".checks")
        and not m.startswith(t.removesuffix("checks"))
    )


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), plus self-imports."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph.get(v, ()):
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


GRAPH = import_graph(modules())


def test_every_module_has_a_layer():
    for m in GRAPH:
        layer(m)


def test_imports_point_down_the_layers():
    assert upward_imports(GRAPH) == []


def test_the_library_never_imports_a_stage_or_an_entry_point():
    back = sorted(
        f"{m} imports {t}"
        for m, ts in GRAPH.items()
        if layer(m) < ENTRY
        for t in ts
        if layer(t) == ENTRY
    )
    assert back == []


def test_each_folder_is_one_layer():
    """A folder holds one layer, so a module's folder says its layer."""
    assert split_folders() == []
    for m in GRAPH:
        assert layer(m) == layer(folder(m)) or m.endswith(".cli"), m


def root_modules(mods) -> list[str]:
    """The modules that lie loose in the package root (not in a folder)."""
    return sorted(m for m in mods if m.count(".") == 1 and not (SRC / m.replace(".", "/")).is_dir())


def test_the_root_holds_only_init_and_main():
    """Every module sits in a folder that names its layer; the root keeps the package's
    `__init__` and `python -m dpadapter`'s `__main__`, and the table names folders only."""
    assert root_modules(GRAPH) == ["dpadapter.__main__"]
    assert sorted(p for p in LAYERS if p != folder(p)) == []
    assert {folder(m) for m in GRAPH} == set(LAYERS)


def test_the_ground_floor_imports_nothing_of_the_package():
    """`ground/` is what every folder may stand on, the config's own included: it imports only
    its own rooms, so no folder of layer 0 leads back into another through it."""
    bad = sorted(
        f"{m} imports {t}"
        for m, ts in GRAPH.items()
        if folder(m) == "dpadapter.ground"
        for t in ts
        if folder(t) != "dpadapter.ground"
    )
    assert bad == []


def test_following_the_algorithm_from_finetune_never_climbs_back_up():
    """From the fine-tuning stage through `train`, `algorithms` and `per_sample` to
    `privacy`, every step goes down (or stays in) a layer, folder by folder."""
    start = "dpadapter.stages.finetune"
    passed = {folder(m) for m in reachable(GRAPH, start)}
    assert {"dpadapter.train", "dpadapter.algorithms", "dpadapter.per_sample"} <= passed
    assert folder_climbs(GRAPH, start) == []


def algorithm_walk(graph: dict[str, set[str]]) -> list[str]:
    """The folders the algorithms' own imports lead into, at or above `train` (the loops that
    call them): an algorithm that reads `train.progress` or `train.resume` climbs back up."""
    return sorted(
        f"{m} reaches {folder(t)}"
        for m in graph
        if folder(m) == "dpadapter.algorithms"
        for t in reachable(graph, m)
        if layer(folder(t)) > LAYERS["dpadapter.algorithms"]
    )


def test_the_algorithms_walk_never_reaches_the_loops():
    """What an algorithm imports, directly or not, lies at its layer or below."""
    assert len([m for m in GRAPH if folder(m) == "dpadapter.algorithms"]) >= 7
    assert algorithm_walk(GRAPH) == []


def test_privacy_imports_no_training_code():
    """privacy/ is accounting, calibration and the ledger: it may use the foundation only."""
    bad = sorted(
        f"{m} imports {t}"
        for m, ts in GRAPH.items()
        if m.startswith("dpadapter.privacy")
        for t in ts
        if not t.startswith("dpadapter.privacy") and layer(t) > 0
    )
    assert bad == []


def test_a_feature_never_imports_another_features_checks():
    assert foreign_checks(GRAPH) == []


def test_validation_composes_every_features_checks():
    """A checks module that `validation` does not import is never run before a job starts."""
    owned = {m for m in GRAPH if m.endswith(".checks")}
    assert len(owned) >= 6  # data, stages, upstream, hpo, federated, audit
    assert owned - GRAPH["dpadapter.validation.compose"] == set()


# Inside tracking, each room imports only the rooms listed before it (`ui` is `make mlflow`'s),
# and none imports the package itself (its __init__ re-exports the rooms).
TRACKING_ORDER = ("naming", "store", "lifecycle", "run", "ui")


def tracking_climbs(graph: dict[str, set[str]]) -> list[str]:
    order = {f"dpadapter.tracking.{r}": i for i, r in enumerate(TRACKING_ORDER)}
    return sorted(
        f"{m} imports {t}"
        for m, ts in graph.items()
        if m in order
        for t in ts
        if t.startswith("dpadapter.tracking") and order.get(t, len(order)) >= order[m]
    )


def test_tracking_rooms_import_only_the_rooms_before_them():
    assert {f"dpadapter.tracking.{r}" for r in TRACKING_ORDER} <= set(GRAPH)
    assert tracking_climbs(GRAPH) == []


def test_no_import_cycle():
    assert cycles(GRAPH) == []


@pytest.mark.parametrize(
    "planted, check",
    [
        ({"dpadapter.privacy.accounting": {"dpadapter.train.dp_fit"}}, upward_imports),
        ({"dpadapter.train.dp_fit": {"dpadapter.stages.finetune"}}, upward_imports),
        ({"dpadapter.data.tasks": {"dpadapter.models.factory"},
          "dpadapter.models.factory": {"dpadapter.data.tasks"}}, cycles),
        ({"dpadapter.hpo.checks": {"dpadapter.federated.checks"}}, foreign_checks),
        ({"dpadapter.audit.stage": {"dpadapter.data.checks"}}, foreign_checks),
        ({"dpadapter.tracking.run": {"dpadapter.tracking.ui"}}, tracking_climbs),
        ({"dpadapter.tracking.store": {"dpadapter.tracking"}}, tracking_climbs),
        ({"dpadapter.algorithms.base": {"dpadapter.train.progress"}}, algorithm_walk),
        ({"dpadapter.algorithms.dpsat": {"dpadapter.train.resume"}}, algorithm_walk),
    ],
)  # fmt: skip
def test_the_checks_find_a_planted_violation(planted, check):
    graph = {m: set(ts) for m, ts in GRAPH.items()}
    for m, ts in planted.items():
        graph[m] |= ts
    assert check(graph)


def test_the_folder_checks_find_a_planted_violation():
    """The old layout: per_sample, layer 2, inside train/, layer 4; and a per-sample module
    that imports the training loop from below it."""
    assert split_folders({**LAYERS, "dpadapter.train.per_sample": 2})
    graph = {m: set(ts) for m, ts in GRAPH.items()}
    graph["dpadapter.per_sample.clip"] |= {"dpadapter.train.batching"}
    assert folder_climbs(graph, "dpadapter.stages.finetune")
    # the walk the issue found: an algorithm that reads the loop's progress lines
    graph = {m: set(ts) for m, ts in GRAPH.items()}
    graph["dpadapter.algorithms.base"] |= {"dpadapter.train.progress"}
    assert folder_climbs(graph, "dpadapter.stages.finetune")
    # a module loose in the root again
    assert root_modules({**GRAPH, "dpadapter.atomic": set()}) == [
        "dpadapter.__main__",
        "dpadapter.atomic",
    ]
