"""Bad config is reported by key before any work starts."""

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dpadapter.settings import Config, ConfigError, from_dict
from dpadapter.validation.compose import load, validate

REPO = Path(__file__).resolve().parents[2]


def test_a_config_file_loads_the_same_from_any_working_directory(tmp_path, monkeypatch):
    """A file and its `base:` chain are read relative to the file, never to the working
    directory; an overlay's config is its base's with exactly what the overlay writes changed
    (here `configs/paper-epochs.yaml`: its results folder, two `unset:` keys and the upstream
    schedules), and every other section stays the base's."""
    overlay, base_file = REPO / "configs" / "paper-epochs.yaml", REPO / "configs" / "paper.yaml"
    monkeypatch.chdir(REPO)
    here, base = load(overlay.relative_to(REPO)), load(base_file.relative_to(REPO))
    monkeypatch.chdir(tmp_path)
    assert load(overlay) == here and load(base_file) == base
    assert here.results_dir == "results-paper-epochs" != base.results_dir
    written = ("schedule_unit", "epochs", "max_steps")  # what the overlay sets or unsets
    for method in ("dpadapter", "sam"):
        params, before = here.upstream_params[method], base.upstream_params[method]
        assert "max_steps" in before and "max_steps" not in params  # unset:
        assert (params["schedule_unit"], params["epochs"]) == ("epochs", 1000)
        assert {k: v for k, v in params.items() if k not in written} == {
            k: v for k, v in before.items() if k not in written
        }
    changed = {"results_dir", "upstream_params"}
    assert {
        f.name for f in dataclasses.fields(Config) if getattr(here, f.name) != getattr(base, f.name)
    } == changed


@pytest.mark.parametrize(
    "mutate,expected",
    [
        (lambda r: r.update(typo_key=1), "typo_key"),
        (lambda r: r["finetune"].update(epsilons=[-1]), "finetune.epsilons.0"),
        (lambda r: r["finetune"].update(lr_rate=0.1), "lr_rate"),
        (lambda r: r["tasks"]["syn-same"].update(n_train="many"), "tasks.syn-same.n_train"),
        (lambda r: r["finetune"].update(algorithms=["dp-magic"]), "dp-magic"),
        (lambda r: r["pretrain"].update(methods=["alchemy"]), "alchemy"),
        (lambda r: r["public"].update(dataset="imagenet-42"), "imagenet-42"),
        (lambda r: r["model"].update(name="vgg-nope"), "vgg-nope"),
        (lambda r: r["privacy"].update(delta=2), "privacy.delta"),
        (lambda r: r["finetune"].update(grad_sample_mode="ghost"), "grad_sample_mode"),
        (lambda r: r["finetune"].update(compile="fast"), "finetune.compile"),
        (
            lambda r: r["finetune"].update(compile="default", grad_sample_mode="hooks"),
            "finetune.compile: 'default' compiles book-keeping only",
        ),
        (
            lambda r: r["finetune"].update(compile="default", pad_batches=False),
            "finetune.compile: a compiled step is compiled once per batch shape",
        ),
        (
            lambda r: r["finetune"].update(compile="reduce-overhead", algorithms=["dpsgd", "gep"]),
            "finetune.compile: 'gep' reads per-example gradients itself",
        ),
    ],
)
def test_errors_name_the_bad_key(tiny_raw, mutate, expected):
    mutate(tiny_raw)
    with pytest.raises(ConfigError, match=expected.replace(".", r"\.")):
        validate(tiny_raw)


@pytest.mark.process
def test_cli_reports_bad_config_and_exits_2(tmp_path, tiny_raw):
    tiny_raw["warmup"]["epochs"] = "three"
    p = tmp_path / "bad.yaml"
    p.write_text(yaml.safe_dump(tiny_raw))
    r = subprocess.run(
        [sys.executable, "-m", "dpadapter", "--config", str(p), "validate"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2
    assert "warmup.epochs" in r.stderr


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load(tmp_path / "nope.yaml")


def test_finetune_grid_is_main_product_plus_extra_grids(tiny_raw):
    tiny_raw["finetune"]["extra_grids"] = [
        {
            "upstreams": ["standard"],
            "tasks": ["syn-shift"],
            "algorithms": ["dpsgd"],
            "seeds": [0, 7],
        }
    ]
    grid = from_dict(tiny_raw).finetune_grid()
    main = {
        (u, t, "dpsgd", e, 0, "ft")
        for u in ("scratch", "standard")
        for t in ("syn-same", "syn-shift")
        for e in (1.0, 4.0)
    }
    extra = {("standard", "syn-shift", "dpsgd", e, 7, "ft") for e in (1.0, 4.0)}
    assert set(grid) == main | extra and len(grid) == len(main | extra)


def test_strategies_are_an_axis_of_the_grid_and_finetune_strategy_keeps_its_folder(tiny_raw):
    """finetune.strategies multiplies the main grid (an extra grid may name its own); the
    jobs of finetune.strategy stay in the algorithm's folder, so adding strategies moves none."""
    from dpadapter.settings import split_folder

    plain = from_dict(tiny_raw)
    tiny_raw["finetune"]["strategies"] = ["ht", "ft", "ut"]
    tiny_raw["finetune"]["extra_grids"] = [
        {"upstreams": ["standard"], "tasks": ["syn-shift"], "algorithms": ["dpsat"],
         "strategies": ["bitfit"]}
    ]  # fmt: skip
    cfg = from_dict(tiny_raw)
    grid = cfg.finetune_grid()
    assert [j for j in grid if j[5] == "ft"] == plain.finetune_grid()
    assert {j[5] for j in grid} == {"ht", "ft", "ut", "bitfit"}
    assert len(grid) == 3 * len(plain.finetune_grid()) + 2  # + dpsat bitfit at two epsilons
    assert [j[5] for j in grid[:3]] == ["ht", "ft", "ut"]  # the strategy varies fastest
    folders = {cfg.finetune.folder(j[2], j[5]) for j in grid}
    assert folders == {"dpsgd", "dpsgd+ht", "dpsgd+ut", "dpsat+bitfit"}
    assert {split_folder(f) for f in folders} == {
        ("dpsgd", None), ("dpsgd", "ht"), ("dpsgd", "ut"), ("dpsat", "bitfit")
    }  # fmt: skip
    # a published table is compared with one strategy's runs
    tiny_raw["reference"] = {
        "name": "a table", "source": "a paper", "upstream": "scratch", "task": "syn-same",
        "baseline": "dpsgd", "improved": "dpsgd",
        "cells": [{"algorithm": "dpsgd", "epsilon": 1, "mean": 80.0, "std": 0.5}],
    }  # fmt: skip
    with pytest.raises(ConfigError, match=r"finetune\.strategies: the published table"):
        validate(tiny_raw)
    tiny_raw["finetune"]["strategies"] = ["ht"]
    tiny_raw["finetune"]["extra_grids"] = []
    validate(tiny_raw)
    del tiny_raw["reference"]
    tiny_raw["finetune"]["strategies"] = ["ft", "ft"]
    with pytest.raises(ConfigError, match=r"finetune\.strategies"):
        validate(tiny_raw)
    tiny_raw["finetune"]["strategies"] = ["lora"]
    with pytest.raises(ConfigError, match=r"finetune\.strategies"):
        validate(tiny_raw)


def test_extra_grid_names_are_checked(tiny_raw):
    tiny_raw["finetune"]["extra_grids"] = [{"upstreams": ["sam"], "algorithms": ["dpsgd"]}]
    with pytest.raises(ConfigError, match=r"extra_grids\.0\.upstreams"):
        validate(tiny_raw)


def test_each_section_checks_itself_without_the_registries():
    """What a section can tell alone it tells where it is built (`__post_init__`), or lists
    by `problems()` where the problem must wait for the target that runs the section."""
    from dpadapter.settings import (
        AuditConfig,
        DataConfig,
        FederatedConfig,
        FedMechanismConfig,
        FinetuneConfig,
        HPOConfig,
        PrivacyConfig,
    )

    with pytest.raises(ConfigError, match=r"data\.normalization: 2 mean\(s\) but 1 std"):
        DataConfig(normalization=((0.5, 0.5), (0.2,)))
    with pytest.raises(ConfigError, match=r"privacy\.randomness: 'dice'"):
        PrivacyConfig(randomness="dice")
    with pytest.raises(ConfigError, match=r"hpo\.target_epsilons: linear-probe needs >= 1"):
        HPOConfig(target_epsilons=())
    assert FinetuneConfig().problems() == []
    assert FinetuneConfig(compile=False).compile == "off"  # YAML's bare `off`
    assert FinetuneConfig(compile="default").problems() == []
    assert (
        FinetuneConfig(optimizer="adam", momentum=0.9)
        .problems()[0]
        .startswith("finetune.momentum: adam has no momentum")
    )
    hpo = HPOConfig(regime="network", sweep_epsilons=(0.2, 0.1), lr_range=(2.0, 1.0))
    assert [p.split(":")[0] for p in hpo.problems()] == [
        "hpo.sweep_epsilons",
        "hpo.lr_range",
    ]
    laplace = FedMechanismConfig(epsilons=(1.0,), max_grad_norm=1.0, lr=1.0, sample_rate=0.5)
    assert FederatedConfig(laplace=laplace).problems() == [
        "federated.laplace.sample_rate: must be 1 (Theorem 1 uses every example)"
    ]
    assert AuditConfig(canaries=10, guesses=(5, 6)).problems() == [
        "audit.guesses: every k needs 2k <= audit.canaries = 10"
    ]
    assert AuditConfig().problems() == []


def test_every_job_grid_expands_through_the_one_grid(tiny_raw):
    """First axis slowest, each job once at its first place; the fine-tuning, federated, HPO
    and audit grids are unions of such products."""
    from dpadapter.audit.stage import audit_jobs
    from dpadapter.hpo import jobs as hpo_jobs
    from dpadapter.hpo import probe_pairs
    from dpadapter.settings.grid import grid, union

    assert grid("ab", (1, 2)) == [("a", 1), ("a", 2), ("b", 1), ("b", 2)]
    assert grid("aba", (1,)) == [("a", 1), ("b", 1)]
    assert union([(1,), (2,)], [(2,), (3,)]) == [(1,), (2,), (3,)]
    tiny_raw["audit"] = {"algorithms": ["dpsgd"], "epsilons": [1, 2], "federated": ["gaussian"]}
    cfg = from_dict(tiny_raw)
    ft = cfg.finetune
    assert cfg.finetune_grid() == grid(
        cfg.upstreams, cfg.grid_tasks(), ft.algorithms, ft.epsilons, ft.seeds, (ft.strategy,)
    )
    h = cfg.hpo
    pairs = grid(h.upstreams or cfg.upstreams, h.tasks or tuple(cfg.tasks))
    assert probe_pairs(cfg) == pairs
    assert hpo_jobs(cfg) == [(u, t, a, s) for (u, t), a, s in grid(pairs, h.algorithms, h.seeds)]
    assert audit_jobs(cfg) == grid(["dpsgd", "federated-gaussian"], [1.0, 2.0])
    jobs = cfg.federated.jobs(cfg.upstreams)
    assert jobs and len(set(jobs)) == len(jobs)
