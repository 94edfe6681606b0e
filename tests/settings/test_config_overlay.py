"""`base:` overlays: a config file names only what differs from another one.

Merge rule, chains, refused cycles and missing bases, `unset:`, problem lines pointed at the
file of the chain that wrote the key (overlay or base), the merged file written beside the
results, and every shipped config in configs/ loading, merging and validating.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import snakemake_runner  # tests/ is on sys.path
import yaml

from dpadapter.settings import (
    MERGED_FILE,
    ConfigError,
    config_chain,
    merge,
    read_files,
    read_raw,
    write_merged,
)
from dpadapter.validation.compose import load, validate, validate_files

REPO = Path(__file__).resolve().parents[2]
DEFAULT_TEXT = (REPO / "config.yaml").read_text()
SHIPPED = sorted((REPO / "configs").glob("*.yaml"))


def _line_of(text: str, needle: str, start: int = 1) -> int:
    for i, line in enumerate(text.splitlines(), 1):
        if i >= start and needle in line:
            return i
    raise AssertionError(f"{needle!r} not in the text")


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_mappings_merge_lists_and_scalars_replace_null_is_a_value():
    base = {"a": {"x": 1, "y": [1, 2], "z": {"k": 1}}, "b": 2, "c": 3}
    over = {"a": {"y": [9], "z": None}, "c": None, "d": {"n": 1}}
    out = merge(base, over)
    assert out == {"a": {"x": 1, "y": [9], "z": None}, "b": 2, "c": None, "d": {"n": 1}}
    assert list(out) == ["a", "b", "c", "d"]  # the base's order, new keys after it
    assert base == {"a": {"x": 1, "y": [1, 2], "z": {"k": 1}}, "b": 2, "c": 3}  # untouched
    assert merge({"a": 1}, {"a": {"x": 1}}) == {"a": {"x": 1}}  # a mapping replaces a scalar


def test_a_chain_of_bases_resolves_relative_to_each_file(in_tmp):
    (in_tmp / "root.yaml").write_text("seed: 1\nresults_dir: r\nfinetune: {epochs: 3, lr: 0.5}\n")
    (in_tmp / "sub").mkdir()
    (in_tmp / "sub" / "mid.yaml").write_text("base: ../root.yaml\nfinetune: {epochs: 4}\n")
    (in_tmp / "sub" / "top.yaml").write_text("base: mid.yaml\nseed: 2\n")
    assert [p.name for p in config_chain("sub/top.yaml")] == ["root.yaml", "mid.yaml", "top.yaml"]
    raw = read_raw("sub/top.yaml")
    assert raw == {"seed": 2, "results_dir": "r", "finetune": {"epochs": 4, "lr": 0.5}}
    assert "base" not in raw
    # overrides (a job's --config) still go on top of the merged file
    assert read_raw("sub/top.yaml", {"seed": 7})["seed"] == 7


def test_a_cycle_is_refused_naming_the_files(in_tmp):
    (in_tmp / "a.yaml").write_text("base: b.yaml\nseed: 1\n")
    (in_tmp / "b.yaml").write_text("seed: 0\nbase: a.yaml\n")
    with pytest.raises(ConfigError) as info:
        read_raw("a.yaml")
    msg = str(info.value)
    assert "b.yaml:2: base: cycle of config files: a.yaml -> b.yaml -> a.yaml" in msg, msg
    (in_tmp / "self.yaml").write_text("base: ./self.yaml\n")
    with pytest.raises(ConfigError, match=r"self\.yaml:1: base: cycle .*self\.yaml -> self\.yaml"):
        read_raw("self.yaml")


def test_a_missing_or_malformed_base_is_refused_naming_the_line(in_tmp):
    (in_tmp / "top.yaml").write_text("seed: 1\nbase: nowhere/config.yaml\n")
    with pytest.raises(ConfigError) as info:
        load("top.yaml")
    msg = str(info.value)
    assert "top.yaml:2: base: 'nowhere/config.yaml' not found" in msg, msg
    assert "looked for nowhere/config.yaml" in msg, msg
    (in_tmp / "top.yaml").write_text("base: [a.yaml]\n")
    with pytest.raises(ConfigError, match=r"top\.yaml:1: base: must be the path of another"):
        read_raw("top.yaml")


def test_unset_removes_keys_of_the_base_and_refuses_unknown_ones(in_tmp):
    (in_tmp / "config.yaml").write_text(DEFAULT_TEXT)
    (in_tmp / "top.yaml").write_text("base: config.yaml\nunset: [pretrain.params.sam]\n")
    raw = read_raw("top.yaml")
    assert "sam" not in raw["pretrain"]["params"] and "unset" not in raw
    assert raw["pretrain"]["params"]["dpadapter"]["m1"] == 1024
    (in_tmp / "top.yaml").write_text("base: config.yaml\nseed: 1\nunset: [pretrain.params.sma]\n")
    with pytest.raises(
        ConfigError, match=r"top\.yaml:3: unset: 'pretrain.params.sma' is not a key"
    ):
        read_raw("top.yaml")


def test_a_duplicate_key_in_the_base_is_refused(in_tmp):
    (in_tmp / "base.yaml").write_text("seed: 0\nseed: 1\n")
    (in_tmp / "top.yaml").write_text("base: base.yaml\n")
    with pytest.raises(ConfigError, match=r"base\.yaml:2: seed: duplicate key"):
        read_raw("top.yaml")
    with pytest.raises(ConfigError, match=r"base\.yaml:2: seed: duplicate key"):
        validate_files({"base": "base.yaml"}, ["top.yaml"])


def _overlay(in_tmp: Path, base_text: str, top_text: str) -> None:
    (in_tmp / "configs").mkdir(exist_ok=True)
    (in_tmp / "config.yaml").write_text(base_text)
    (in_tmp / "configs" / "top.yaml").write_text(top_text)


def test_problems_point_at_the_overlay_or_the_base_whichever_wrote_the_key(in_tmp):
    base = DEFAULT_TEXT.replace("  noise_std: 0.05\n", "  noise_sd: 0.05\n", 1)  # base's typo
    top = "base: ../config.yaml\nfinetune:\n  epochs: six\n  lr: 0.5\n"
    _overlay(in_tmp, base, top)
    with pytest.raises(ConfigError) as info:
        load("configs/top.yaml")
    msg = str(info.value)
    assert "  configs/top.yaml:3: finetune.epochs: 'six' is not of type 'integer'" in msg, msg
    noise = _line_of(base, "  noise_sd: 0.05")
    assert f"  config.yaml:{noise}: robustness.noise_sd: unknown key" in msg, msg


def test_a_base_key_inside_a_section_the_overlay_also_writes_is_pointed_at_the_base(in_tmp):
    at = DEFAULT_TEXT.index("\n  epochs: ", DEFAULT_TEXT.index("\nfinetune:")) + 1
    end = DEFAULT_TEXT.index("\n", at)
    epochs = DEFAULT_TEXT[at:end].split(": ")[1]  # the finetune section's, quoted below
    base = f'{DEFAULT_TEXT[:at]}  epochs: "{epochs}"{DEFAULT_TEXT[end:]}'
    _overlay(in_tmp, base, "base: ../config.yaml\nfinetune:\n  lr: 0.25\n")
    with pytest.raises(ConfigError) as info:
        load("configs/top.yaml")
    line = _line_of(base, f'  epochs: "{epochs}"', _line_of(base, "finetune:"))
    assert f"  config.yaml:{line}: finetune.epochs: '{epochs}' is not of type" in str(info.value)


def test_a_json_overlay_is_merged_and_pointed_at_too(in_tmp):
    (in_tmp / "config.yaml").write_text(DEFAULT_TEXT)
    (in_tmp / "top.json").write_text(
        '{\n "base": "config.yaml",\n "finetune": {\n  "epochs": "six"\n }\n}\n'
    )
    with pytest.raises(ConfigError) as info:
        load("top.json")
    assert "  top.json:4: finetune.epochs: 'six' is not of type 'integer'" in str(info.value)


def test_a_cross_field_problem_the_overlay_brings_is_pointed_at_the_overlay(in_tmp):
    """The overlay lowers audit.canaries; the base's audit.guesses no longer fit. The fix
    belongs in the overlay (the base is a shipped file, right on its own): the message points at
    the overlay's line and names the base's line that holds the value (issue 36, 2). (An
    overlay's `unset:` of a task takes the base's mentions of it along: test_task_refs.py.)"""
    top = "base: ../config.yaml\naudit:\n  canaries: 100\n"
    _overlay(in_tmp, DEFAULT_TEXT, top)
    with pytest.raises(ConfigError) as info:
        load("configs/top.yaml")
    msg = str(info.value)
    at = _line_of(DEFAULT_TEXT, "  guesses:", _line_of(DEFAULT_TEXT, "audit:"))
    assert "  configs/top.yaml:3: audit.guesses: every k needs 2k <= audit.canaries" in msg, msg
    assert f"(audit.guesses is written at config.yaml:{at}, which this file's changes" in msg
    assert "set audit.guesses in configs/top.yaml" in msg, msg


def test_a_list_the_overlay_replaces_is_pointed_at_in_the_overlay(in_tmp):
    """Item 0 of the base's list is gone with the list: the overlay's item is named."""
    top = "base: ../config.yaml\nfinetune:\n  epsilons:\n    - four\n"
    _overlay(in_tmp, DEFAULT_TEXT, top)
    with pytest.raises(ConfigError) as info:
        load("configs/top.yaml")
    assert "  configs/top.yaml:4: finetune.epsilons.0: 'four' is not of type" in str(info.value)


def test_snakemake_style_files_and_overrides_merge_like_snakemake(in_tmp):
    _overlay(in_tmp, DEFAULT_TEXT, "base: ../config.yaml\nseed: 3\n")
    (in_tmp / "more.yaml").write_text("finetune: {epochs: 2}\n")
    raw = read_files(["configs/top.yaml", "more.yaml"], {"privacy": {"delta": 1.0e-6}})
    assert raw["seed"] == 3 and raw["finetune"]["epochs"] == 2
    assert raw["finetune"]["lr"] == 0.1  # merged, as Snakemake merges config files
    assert raw["privacy"] == {"delta": 1.0e-6, "accountant": "prv"}
    validate(raw)


def test_the_merged_file_is_the_whole_config_and_reads_back_equal(in_tmp):
    _overlay(in_tmp, DEFAULT_TEXT, "base: ../config.yaml\nresults_dir: res-top\nseed: 3\n")
    raw = read_raw("configs/top.yaml")
    out = write_merged(raw, "res-top", ["configs/top.yaml"])
    assert out == Path("res-top") / MERGED_FILE
    text = out.read_text()
    assert text.startswith("# The effective config of res-top/: configs/top.yaml"), text[:200]
    assert yaml.safe_load(text) == raw
    assert load(out).to_dict() == load("configs/top.yaml").to_dict()


@pytest.mark.slow  # over ~1.5 s: make check's 2 minutes (docs/testing.md)
@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_every_shipped_config_loads_merges_and_validates(path):
    cfg = load(path)
    raw = read_raw(path)
    assert "base" not in raw and "unset" not in raw
    assert cfg.results_dir == raw["results_dir"]


@pytest.mark.slow  # in-process, too long for `make check`
def test_overlays_own_their_results_folder():
    """An overlay that forgot `results_dir` would write into its base's results. Configs that
    share a folder on purpose (configs/strategies.yaml: the default grid under three tuning
    strategies, beside the default run's jobs; configs/table1.yaml: every algorithm and a third
    task beside them) must be one experiment: they differ only in
    which jobs exist, so `identity.check` lets them share it and no job of one reruns another's."""
    from dpadapter.workflow.identity import differences, sections

    by_dir: dict[str, list[Path]] = {}
    for p in [REPO / "config.yaml", *SHIPPED]:
        by_dir.setdefault(read_raw(p)["results_dir"], []).append(p)
    shared = {d: [p.name for p in ps] for d, ps in by_dir.items() if len(ps) > 1}
    assert shared == {"results": ["config.yaml", "strategies.yaml", "table1.yaml"]}, shared
    for ps in by_dir.values():
        first = load(ps[0])
        for p in ps[1:]:
            names, lines = differences({"sections": sections(first)}, load(p))
            assert names == [], (p.name, lines)
    # the guard holds: an overlay that changes a setting in a shared folder is caught
    cfg = load(REPO / "configs" / "strategies.yaml")
    lr = dataclasses.replace(cfg, finetune=dataclasses.replace(cfg.finetune, lr=0.123))
    assert differences({"sections": sections(load(REPO / "config.yaml"))}, lr)[0] == ["finetune"]


def _snakemake(workdir: Path, configfile: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "snakemake", "--snakefile", str(REPO / "Snakefile")]
    # targets before --configfile, which takes every argument after it
    cmd += ["--directory", str(workdir), "--cores", "1", *args, "--configfile", str(configfile)]
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{workdir / 'mlruns.db'}"}
    return snakemake_runner.run(cmd, capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.slow
def test_snakemake_sees_the_merged_config_of_an_overlay(tmp_path, tiny_raw, shared_fork_servers):
    """A dry run plans the merged grid; a real run of one job writes the merged file (its job
    forked from the worker's fork servers, `shared_fork_servers`, where they are up)."""
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(tiny_raw, sort_keys=False))
    (tmp_path / "top.yaml").write_text(
        "base: base.yaml\nresults_dir: res-top\nfinetune: {seeds: [0, 1, 2]}\n"
    )
    r = _snakemake(tmp_path, tmp_path / "top.yaml", "-n")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    # 2 upstreams x 2 tasks x 1 algorithm x 2 epsilons x 3 seeds (the overlay's seeds)
    counts = dict(re.findall(r"^(\w+)\s+(\d+)\s*$", out.split("Job stats:")[1], re.M))
    assert counts["finetune"] == "24" and counts["warmup"] == "1", counts
    assert "res-top/warmup/model.pt" in out
    assert not (tmp_path / "res-top").exists()  # a dry run writes nothing

    r = _snakemake(tmp_path, tmp_path / "top.yaml", "res-top/pretrain/scratch/model.pt")
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    merged = yaml.safe_load((tmp_path / "res-top" / MERGED_FILE).read_text())
    assert merged == read_raw(tmp_path / "top.yaml")
    assert merged["finetune"]["seeds"] == [0, 1, 2] and merged["model"] == tiny_raw["model"]


@pytest.mark.slow
def test_snakemake_refuses_a_missing_base_before_any_job(tmp_path):
    (tmp_path / "top.yaml").write_text("base: gone.yaml\nresults_dir: r\n")
    r = _snakemake(tmp_path, tmp_path / "top.yaml", "-n")
    out = r.stdout + r.stderr
    assert r.returncode != 0
    assert "top.yaml:1: base: 'gone.yaml' not found" in out, out[-3000:]
    assert "Traceback" not in out, out[-3000:]


def test_algo_params_for_overrides_per_upstream_and_task():
    """DP-SAT Table 3 tunes the radius per model and dataset: entries apply in order, key by
    key, on top of finetune.algo_params, and only to the jobs they name."""
    import copy

    from tiny_config import TINY_RAW

    from dpadapter.validation.compose import validate

    tiny_raw = lambda: copy.deepcopy(TINY_RAW)  # noqa: E731

    raw = tiny_raw()
    raw["finetune"]["algo_params"] = {"dpsat": {"rho": 0.1}}
    raw["finetune"]["algo_params_for"] = [
        {"tasks": [next(iter(raw["tasks"]))], "algo_params": {"dpsat": {"rho": 0.3}}},
        {"upstreams": ["scratch"], "algo_params": {"dpsat": {"rho": 0.7}}},
    ]
    cfg = validate(raw)
    task = next(iter(raw["tasks"]))
    ft = cfg.finetune
    assert ft.params_of("dpsat") == {"rho": 0.1}
    assert ft.params_of("dpsat", "standard", task) == {"rho": 0.3}
    assert ft.params_of("dpsat", "scratch", task) == {"rho": 0.7}
    assert ft.params_of("dpsat", "scratch", "other") == {"rho": 0.7}
    assert ft.params_of("dpsgd", "scratch", task) == {}
    bad = tiny_raw()
    bad["finetune"]["algo_params_for"] = [
        {"tasks": ["nope"], "algo_params": {"dpsat": {"rho": 0.3}}},
        {"algo_params": {"dpsat": {"rhoo": 0.3}}},
    ]
    with pytest.raises(ConfigError) as e:
        validate(bad)
    assert "rhoo" in str(e.value)
    bad["finetune"]["algo_params_for"].pop()
    with pytest.raises(ConfigError, match=r"algo_params_for\.0\.tasks"):
        validate(bad)


@pytest.mark.slow  # in-process, too long for `make check`
def test_an_overlay_swapping_a_hub_source_for_a_file_is_told_to_unset_it(in_tmp):
    """An overlay's `weights: {file}` merges with the base's `{hub: true}`; jsonschema says only
    "not valid under any of the given schemas". The message names the key, both sources, and
    the `unset:` to write; written, the overlay validates."""
    base = "base: ../configs/dpsat-table3.yaml\nresults_dir: results/b\n"
    top = "base: base.yaml\npretrain:\n  external:\n    vit-s: {weights: {file: w/vit.pth}}\n"
    (in_tmp / "configs").mkdir()
    for name in ("dpsat-table3.yaml",):
        (in_tmp / "configs" / name).write_text((REPO / "configs" / name).read_text())
    (in_tmp / "configs" / "base.yaml").write_text(base)
    (in_tmp / "configs" / "top.yaml").write_text(top)
    with pytest.raises(ConfigError) as info:
        load("configs/top.yaml")
    msg = str(info.value)
    assert (
        "configs/top.yaml:4: pretrain.external.vit-s.weights: one of file, hub, torchvision, "
        "not file and hub together" in msg
    ), msg
    assert "`unset: [pretrain.external.vit-s.weights]`" in msg and "{file: w/vit.pth}" in msg
    fixed = top.replace(
        "base: base.yaml\n", "base: base.yaml\nunset: [pretrain.external.vit-s.weights]\n"
    )
    (in_tmp / "configs" / "top.yaml").write_text(fixed)
    assert load("configs/top.yaml").external_upstreams["vit-s"]["weights"] == {"file": "w/vit.pth"}
