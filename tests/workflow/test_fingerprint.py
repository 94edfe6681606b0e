"""The rules' rerun triggers (dpadapter.workflow.fingerprint): the same values as the hand-written
ones
they replaced (so finished results are not rerun after an upgrade), every new key of a section
a stage reads reruns it, and a bigger grid reruns nothing already built."""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path

import pytest
from snakemake.iocontainers import Wildcards
from tiny_config import TINY_RAW

from dpadapter.settings import read_raw
from dpadapter.upstream.variants import parse_variant
from dpadapter.workflow.fingerprint import STAGES, stage_fingerprint

REPO = Path(__file__).resolve().parents[2]
CONFIGS = {"config.yaml": REPO / "config.yaml"} | {
    f"configs/{p.name}": p for p in sorted((REPO / "configs").glob("*.yaml"))
}


def _load(name: str) -> dict:
    if name == "tiny":
        return copy.deepcopy(TINY_RAW)
    return read_raw(CONFIGS[name])  # overlays (`base:`) merged, as the workflow sees them


# --- The hand-written fingerprints of workflow/rules/*.smk before dpadapter.workflow.fingerprint,
# with
# --- `config` made an argument. The reference: do not edit.


def old_fingerprint(config, *keys):
    sub = {k: config.get(k) for k in keys}
    return hashlib.sha256(json.dumps(sub, sort_keys=True, default=str).encode()).hexdigest()[:16]


def old_warmup(config, wc):
    return old_fingerprint(config, "data", "public", "model", "warmup", "seed", "robustness")


def old_pretrain(config, wildcards):
    params = config.get("pretrain", {}).get("params", {})
    base = parse_variant(wildcards.upstream)[0]
    own = params.get(base, {})
    matched = params.get(own.get("match", "dpadapter"), {}) if base == "control" else {}
    return old_fingerprint(config, "data", "public", "model", "seed", "robustness") + json.dumps(
        [own, matched], sort_keys=True
    )


_GRID_KEYS = {"algorithms", "epsilons", "seeds", "extra_grids", "algo_params"}


def old_finetune(config, wildcards):
    ft = {k: v for k, v in config.get("finetune", {}).items() if k not in _GRID_KEYS}
    algo = config.get("finetune", {}).get("algo_params", {}).get(wildcards.algo, {})
    task = config["tasks"][wildcards.task]
    return old_fingerprint(config, "data", "privacy", "robustness", "public") + json.dumps(
        [ft, algo, task], sort_keys=True
    )


def old_hpo(config, wc):
    return old_fingerprint(config, "data", "finetune", "privacy", "hpo") + json.dumps(
        config["tasks"][wc.task], sort_keys=True
    )


def old_probe(config, wc):
    return old_fingerprint(config, "data", "public", "privacy", "hpo") + json.dumps(
        config["tasks"][wc.task], sort_keys=True
    )


OLD = {
    "warmup": old_warmup,
    "pretrain": old_pretrain,
    "finetune": old_finetune,
    "hpo": old_hpo,
    "hpo-probe": old_probe,
}

# ---


def _jobs(config: dict) -> list[Wildcards]:
    """Wildcards of a few jobs of `config`: every task, upstream method (a variant and control
    among them) and algorithm it names, as Snakemake hands them to a params function."""
    ft = config.get("finetune", {})
    upstreams = [*config.get("pretrain", {}).get("methods", []), "control", "dpadapter+gamma=0.5"]
    algos = [*ft.get("algorithms", []), *ft.get("algo_params", {}), "federated-gaussian"]
    tasks = list(config["tasks"])
    n = max(len(upstreams), len(algos), len(tasks))
    return [
        Wildcards(
            fromdict={
                "upstream": upstreams[i % len(upstreams)],
                "task": tasks[i % len(tasks)],
                "algo": algos[i % len(algos)],
                "eps": "1",
                "seed": "0",
            }
        )
        for i in range(n)
    ]


def _newer_than_the_formulas(config: dict, stage: str, wc: Wildcards) -> bool:
    """A job that reads keys added after the hand-written formulas: an external backbone's
    params (`pretrain.external`), per-upstream/task algorithm params (`algo_params_for`), the
    strategies' axis (`finetune.strategies`: left out, `test_a_bigger_grid_reruns_...`). Their
    fingerprints are checked by the tests below instead."""
    if stage == "pretrain":
        return wc.upstream in config.get("pretrain", {}).get("external", {})
    ft = config.get("finetune", {})
    # `finetune.recipes` (per-algorithm recipes): test_an_algorithms_recipe_reruns_...
    newer = ("algo_params_for", "strategies", "recipes")
    return stage == "finetune" and any(ft.get(k) for k in newer)


@pytest.mark.parametrize("stage", sorted(OLD))
@pytest.mark.parametrize("name", [*CONFIGS, "tiny"])
def test_fingerprints_keep_their_values(name, stage):
    config = _load(name)
    jobs = [wc for wc in _jobs(config) if not _newer_than_the_formulas(config, stage, wc)]
    assert jobs or stage == "finetune", (name, stage)  # control / variants always compare
    for wc in jobs:
        assert stage_fingerprint(config, stage, wc) == OLD[stage](config, wc), (name, stage, wc)


def test_an_external_backbones_params_rerun_its_pretrain_job_only():
    config = _load("configs/dpsat-table3.yaml")
    changed = copy.deepcopy(config)
    changed["pretrain"]["external"]["vit-s"]["weights"] = {"file": "elsewhere.pt"}
    same = {}
    for up in ("vit-s", "deit-b"):
        wc = _job(config, upstream=up)
        same[up] = stage_fingerprint(changed, "pretrain", wc) == stage_fingerprint(
            config, "pretrain", wc
        )
    assert same == {"vit-s": False, "deit-b": True}


def test_every_stage_has_a_reference_but_the_audit_and_federated():
    """Two values changed on purpose: the audit named the fine-tune keys it read, and the
    federated fingerprint missed the fine-tune section its clients read (grad_sample_mode,
    pad_batches)."""
    assert set(STAGES) == set(OLD) | {"audit", "federated"}


def _job(config: dict, **over) -> Wildcards:
    task = next(iter(config["tasks"]))
    wc = {"upstream": "dpadapter", "task": task, "algo": "dpsgd", "eps": "1", "seed": "0"}
    return Wildcards(fromdict={**wc, **over})


JOBS = [{}, {"upstream": "control"}, {"upstream": "dpadapter+gamma=2"}, {"algo": "dpsgd+ht"}]


@pytest.mark.parametrize("stage", sorted(s for s in STAGES if "finetune" in STAGES[s].reads()))
@pytest.mark.parametrize("key", ["a_new_setting", "strategy", "pad_batches", "sample_rate_from"])
def test_any_finetune_setting_reruns_every_stage_that_reads_finetune(stage, key):
    config = _load("config.yaml")
    for over in JOBS:
        before = stage_fingerprint(config, stage, _job(config, **over))
        changed = copy.deepcopy(config)
        changed["finetune"][key] = "something else"
        assert stage_fingerprint(changed, stage, _job(config, **over)) != before, (stage, key)


@pytest.mark.parametrize(
    ("stage", "section"), sorted((s, sec) for s, spec in STAGES.items() for sec in spec.reads())
)
def test_a_new_key_in_a_section_a_stage_reads_reruns_it(stage, section):
    """Exclusion lists, not inclusion lists: a key added to a section later is covered."""
    config = _load("config.yaml")
    wc = _job(config)
    changed = copy.deepcopy(config)
    if section == "tasks":  # a job reads its own task's entry
        changed["tasks"][wc["task"]]["a_new_setting"] = 1
    elif section == "pretrain":  # ... and its upstream method's params
        changed["pretrain"]["params"].setdefault(wc["upstream"], {})["a_new_setting"] = 1
    elif isinstance(changed.get(section), dict):
        changed[section]["a_new_setting"] = 1
    else:
        changed[section] = "something else"
    assert stage_fingerprint(changed, stage, wc) != stage_fingerprint(config, stage, wc)


def _append(*path):
    def mutate(config):
        node = config
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = [*node.get(path[-1], []), 99]

    return mutate


def _another_algorithms_params(config):
    config["finetune"].setdefault("algo_params", {})["some-other-algorithm"] = {"rho": 0.1}


def _another_algorithms_recipe(config):
    config["finetune"].setdefault("recipes", {})["some-other-algorithm"] = {"lr": 0.5}


def _another_methods_params(config):
    config["pretrain"]["params"]["some-other-method"] = {"lr": 0.1}


# Changes of the grid's extent only: another seed, epsilon, algorithm, sub-grid, mechanism.
GRID_CHANGES = {
    "finetune.seeds": (_append("finetune", "seeds"), "finetune"),
    "finetune.epsilons": (_append("finetune", "epsilons"), "finetune"),
    "finetune.algorithms": (_append("finetune", "algorithms"), "finetune"),
    "finetune.extra_grids": (_append("finetune", "extra_grids"), "finetune"),
    "finetune.strategies": (_append("finetune", "strategies"), "finetune"),
    "finetune.algo_params": (_another_algorithms_params, "finetune"),
    "finetune.recipes": (_another_algorithms_recipe, "finetune"),
    "pretrain.methods": (_append("pretrain", "methods"), "pretrain"),
    "pretrain.params": (_another_methods_params, "pretrain"),
    "audit.epsilons": (_append("audit", "epsilons"), "audit"),
    "audit.algorithms": (_append("audit", "algorithms"), "audit"),
    "audit.federated": (_append("audit", "federated"), "audit"),
    "federated.seeds": (_append("federated", "seeds"), "federated"),
    "federated.mechanisms": (_append("federated", "mechanisms"), "federated"),
    "federated.gaussian.epsilons": (_append("federated", "gaussian", "epsilons"), "federated"),
    "federated.laplace.epsilons": (_append("federated", "laplace", "epsilons"), "federated"),
    "federated.sweep_seeds": (_append("federated", "sweep_seeds"), "federated"),
    "hpo.seeds": (_append("hpo", "seeds"), "hpo"),
}


@pytest.mark.parametrize("change", sorted(GRID_CHANGES))
@pytest.mark.parametrize("stage", sorted(STAGES))
def test_a_bigger_grid_reruns_no_finished_job(stage, change):
    """Except where a stage hashes the section whole, as the HPO always has (hpo, finetune)
    and the audit the federated section."""
    mutate, section = GRID_CHANGES[change]
    config = _load("config.yaml")
    changed = copy.deepcopy(config)
    mutate(changed)
    for over in JOBS:
        wc = _job(config, **over)
        same = stage_fingerprint(changed, stage, wc) == stage_fingerprint(config, stage, wc)
        assert same != (section in STAGES[stage].sections), (stage, change, over)


def test_the_fingerprint_module_imports_only_the_stdlib():
    import ast
    import sys

    import dpadapter.workflow.fingerprint as mod

    tree = ast.parse(Path(mod.__file__).read_text())
    roots = {
        (n.module if isinstance(n, ast.ImportFrom) else a.name).split(".")[0]
        for n in ast.walk(tree)
        if isinstance(n, ast.Import | ast.ImportFrom)
        for a in (n.names if isinstance(n, ast.Import) else [n])
    }
    assert roots <= set(sys.stdlib_module_names) | {"__future__"}, roots


def test_algo_params_for_reruns_only_the_jobs_it_applies_to():
    config = _load("config.yaml")
    task = next(iter(config["tasks"]))
    changed = copy.deepcopy(config)
    changed["finetune"]["algo_params_for"] = [
        {"upstreams": ["dpadapter"], "tasks": [task], "algo_params": {"dpsgd": {}}},
        {"upstreams": ["sam"], "algo_params": {"dpsgd": {"x": 1}}},
    ]
    same = {}
    for up in ("dpadapter", "sam", "standard"):
        wc = _job(config, upstream=up)
        same[up] = stage_fingerprint(changed, "finetune", wc) == stage_fingerprint(
            config, "finetune", wc
        )
    assert same == {"dpadapter": False, "sam": False, "standard": True}


def test_a_new_folder_reruns_no_finetune_job_when_an_upstream_is_added():
    """Version 2 (a results folder begun by this code) leaves `finetune.upstreams` out of a
    fine-tuning job's trigger; version 1 (a folder built before) keeps it, as its finished jobs
    were built with it, so they are carried over, not rerun."""
    from dpadapter.workflow.fingerprint import CURRENT_VERSION

    config = _load("config.yaml")
    config["finetune"].pop("recipes", None)  # the formulas predate per-algorithm recipes
    grown = copy.deepcopy(config)
    grown["finetune"]["upstreams"] = [*config["finetune"]["upstreams"], "control"]
    for wc in _jobs(config):
        new = [stage_fingerprint(c, "finetune", wc, CURRENT_VERSION) for c in (config, grown)]
        assert new[0] == new[1], wc
        assert stage_fingerprint(config, "finetune", wc) == OLD["finetune"](config, wc)
        assert stage_fingerprint(grown, "finetune", wc) != stage_fingerprint(config, "finetune", wc)
    # a setting still reruns under version 2
    changed = copy.deepcopy(config)
    changed["finetune"]["lr"] = 0.123
    wc = _jobs(config)[0]
    assert stage_fingerprint(changed, "finetune", wc, 2) != stage_fingerprint(
        config, "finetune", wc, 2
    )


def test_an_algorithms_recipe_reruns_its_jobs_only_and_is_what_they_train_with():
    """`finetune.recipes.<algo>`: its jobs' trigger is the section with the recipe in place, so
    the same values as the shared section (a recipe equal to it) rerun nothing, other
    algorithms' jobs (and the audit and federated stages, which read the shared recipe) never."""
    config = _load("config.yaml")
    config["finetune"].pop("recipes", None)  # as before recipes existed: the formulas hold
    for wc in _jobs(config):
        assert stage_fingerprint(config, "finetune", wc) == OLD["finetune"](config, wc), wc
    shared = {k: config["finetune"][k] for k in ("lr", "max_grad_norm")}
    same = copy.deepcopy(config)
    same["finetune"]["recipes"] = {"adpclip": dict(shared)}
    other = copy.deepcopy(config)
    other["finetune"]["recipes"] = {"adpclip": {"lr": shared["lr"] * 2}}
    for over in JOBS:
        for algo in ("dpsgd", "adpclip"):
            wc = _job(config, **{**over, "algo": over.get("algo", algo).replace("dpsgd", algo)})
            for stage in ("finetune", "audit", "federated"):
                for version in (1, 2):
                    before = stage_fingerprint(config, stage, wc, version)
                    assert stage_fingerprint(same, stage, wc, version) == before
                    rerun = stage_fingerprint(other, stage, wc, version) != before
                    assert rerun == (stage == "finetune" and algo == "adpclip"), (stage, wc)


def test_a_strategys_job_reads_its_algorithms_params():
    """`dpsgd+ht` (finetune.strategies) is DP-SGD's job: its params rerun it, another's do not."""
    config = _load("config.yaml")
    wc = _job(config, algo="dpsgd+ht")
    before = stage_fingerprint(config, "finetune", wc, 2)
    changed = copy.deepcopy(config)
    changed["finetune"].setdefault("algo_params", {})["dpsat"] = {"rho": 0.3}
    assert stage_fingerprint(changed, "finetune", wc, 2) == before
    changed["finetune"]["algo_params"]["dpsgd"] = {"some_param": 1}
    assert stage_fingerprint(changed, "finetune", wc, 2) != before
