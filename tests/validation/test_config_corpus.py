"""A malformed-config corpus made from `config.yaml`: every mutant is refused, naming its key.

Mutants: every numeric leaf written as a string (`m1: "1024"`, `delta: "1e-05"`), and a
misspelled sibling of every key (`gama` beside `gamma`), in every section including
`pretrain.params.*`, `finetune.algo_params.*`, `federated.*` and `hpo.*`. The names under
`tasks` are the user's own (a new name is a new task), so only the keys inside a task are
misspelled. The whole corpus goes through `dpadapter.validation.compose.validate`, the function
`workflow/rules/common.smk` calls; a handful go through a real `snakemake -n`, which must fail
naming the key and write nothing.
"""

import copy
import os
import sys
from pathlib import Path

import pytest
import snakemake_runner  # tests/ is on sys.path
import yaml

from dpadapter.settings import ConfigError
from dpadapter.validation.compose import validate

REPO = Path(__file__).resolve().parents[2]
BASE = yaml.safe_load((REPO / "config.yaml").read_text())
# `config.yaml` sets no algo_params; the corpus adds one entry per section it can mutate.
BASE["finetune"]["algo_params"] = {
    "dpsat": {"rho": 0.03},
    "adpclip": {"target_quantile": 0.5, "count_noise": 5.0},
    "gep": {"num_bases": 8, "public_labels": "predicted"},
}
FREE_NAMES = {("tasks",)}  # mappings whose keys are user-chosen names


def _typo(key: str, siblings) -> str:
    """A plausible misspelling: two adjacent letters swapped, else the last letter doubled."""
    for i in range(max(len(key) // 2 - 1, 0), len(key) - 1):
        t = key[:i] + key[i + 1] + key[i] + key[i + 2 :]
        if t != key and t not in siblings:
            return t
    return key + key[-1]


def _walk(node, path=()):
    """(path, value) of every node under `node`, parents first."""
    yield path, node
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _walk(v, (*path, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _walk(v, (*path, i))


def _at(raw, path):
    for p in path:
        raw = raw[p]
    return raw


def mutants(base: dict) -> list[tuple[str, dict, str]]:
    """(id, mutated config, dotted key the error must name)."""
    out = []
    for path, value in _walk(base):
        key = ".".join(str(p) for p in path)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            raw = copy.deepcopy(base)
            _at(raw, path[:-1])[path[-1]] = str(value)
            out.append((f"str:{key}", raw, key))
        if isinstance(value, dict) and path not in FREE_NAMES:
            for k in value:
                raw = copy.deepcopy(base)
                parent = _at(raw, path)
                typo = _typo(k, parent)
                parent[typo] = copy.deepcopy(parent[k])
                where = ".".join([*map(str, path), k])
                out.append((f"typo:{where}", raw, ".".join([*map(str, path), typo])))
    return out


CORPUS = mutants(BASE)


def test_the_corpus_reaches_every_section():
    keys = {m[2] for m in CORPUS}
    for prefix in (
        "pretrain.params.dpadapter.",
        "pretrain.params.sam.",
        "pretrain.params.control.",
        "finetune.algo_params.",
        "federated.gaussian.",
        "federated.sweep_epsilons.",
        "hpo.",
        "privacy.",
        "tasks.fmnist-same.",
        "finetune.extra_grids.0.",
    ):
        assert any(k.startswith(prefix) for k in keys), prefix
    assert "pretrain.params.dpadapter.gamma" in keys  # the numeric leaf as a string
    assert "typo:pretrain.params.dpadapter.gamma" in {m[0] for m in CORPUS}  # its misspelling
    assert len(CORPUS) > 200


def test_the_unmutated_base_is_valid():
    validate(copy.deepcopy(BASE))


@pytest.mark.parametrize("mid,raw,key", CORPUS, ids=[m[0] for m in CORPUS])
def test_every_mutant_is_refused_naming_its_key(mid, raw, key):
    with pytest.raises(ConfigError) as info:
        validate(raw)
    lines = str(info.value).splitlines()[1:]
    assert any(line.strip().startswith(f"{key}:") for line in lines), (key, lines)


# A handful of mutants through the real workflow: a non-zero exit, the key on the console,
# nothing in the results folder.
WORKFLOW_MUTANTS = [
    "typo:pretrain.params.dpadapter.gamma",
    "str:pretrain.params.dpadapter.m1",
    "str:privacy.delta",
    "typo:finetune.algo_params.dpsat.rho",
    "str:federated.gaussian.epsilons.0",
]


@pytest.mark.slow
@pytest.mark.parametrize("mid", WORKFLOW_MUTANTS)
def test_snakemake_dry_run_refuses_mutants_and_writes_nothing(tmp_path, mid):
    _, raw, key = next(m for m in CORPUS if m[0] == mid)
    raw["results_dir"] = str(tmp_path / "results")
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(raw))
    r = snakemake_runner.run(
        [
            sys.executable,
            "-m",
            "snakemake",
            "-n",
            "--snakefile",
            str(REPO / "Snakefile"),
            "--directory",
            str(tmp_path),
            "--cores",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlruns.db'}"},
    )
    assert r.returncode != 0
    assert f"{key}:" in r.stdout + r.stderr, (r.stdout + r.stderr)[-3000:]
    assert not (tmp_path / "results").exists()
