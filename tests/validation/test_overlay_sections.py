"""An overlay that brings its own upstreams is stopped only by what it runs (issue 36, item 2).

The user of the issue wrote an overlay of config.yaml naming their own checkpoints as the
upstreams. The base's optional sections (`hpo.upstreams: [standard]`, `federated.strategies:
[scratch, ...]`) then stopped every run, each pointed at a line of config.yaml although the fix
belongs in the overlay, and `unset: [federated]` did not help because the code's default
strategies named `scratch`. Here: the main grid runs; each optional section's problems wait for
its own target (`dpadapter.validation.optional_sections`) and point at the overlay's line; `unset:`
of any section
leaves a config that runs; a default that does not fit is named with its value.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from dpadapter.launch import cli
from dpadapter.settings import ConfigError, read_raw
from dpadapter.settings.problems import locate
from dpadapter.validation.compose import load, validate
from dpadapter.validation.optional_sections import refusal, stage_sections, validate_scoped, warning

REPO = Path(__file__).resolve().parents[2]
DEFAULT_TEXT = (REPO / "config.yaml").read_text()
SECTIONS = [k for k in yaml.safe_load(DEFAULT_TEXT)]
# Two checkpoints of the user's own (a pipeline model: no timm import, no file read here).
EXTERNAL = """\
pretrain:
  methods: [mine-a, mine-b]
  external:
    mine-a: {model: cnn-gn, weights: {file: w/a.pt}, input: {normalization: data}}
    mine-b: {model: cnn-gn, weights: {file: w/b.pt}, input: {normalization: data}}
"""


def _line_of(text: str, needle: str, start: int = 1) -> int:
    for i, line in enumerate(text.splitlines(), 1):
        if i >= start and needle in line:
            return i
    raise AssertionError(f"{needle!r} not in the text")


@pytest.fixture
def overlay(tmp_path, monkeypatch):
    """configs/top.yaml on config.yaml: the user's upstreams, extra grids of their own (none)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "config.yaml").write_text(DEFAULT_TEXT)
    (tmp_path / "configs").mkdir()

    def write(
        head: str = "", finetune: str = "finetune:\n  upstreams: [mine-a]\n  extra_grids: []\n"
    ) -> Path:
        top = tmp_path / "configs" / "top.yaml"
        top.write_text(
            f"base: ../config.yaml\nresults_dir: results/top\n{head}{EXTERNAL}{finetune}"
        )
        return Path("configs/top.yaml")

    return write


def test_the_main_grid_runs_and_each_unused_section_waits_for_its_target(overlay):
    top = overlay()
    text = top.read_text()
    cfg, deferred = validate_scoped(read_raw(top), [top])
    assert cfg.upstreams == ("mine-a", "mine-b")
    assert sorted(deferred) == ["federated", "hpo"]
    deferred_hpo = "\n".join(line for _, line in deferred["hpo"])
    deferred_fed = "\n".join(line for _, line in deferred["federated"])
    methods = _line_of(text, "methods: [mine-a, mine-b]")
    hpo = _line_of(DEFAULT_TEXT, "  upstreams: [standard]", _line_of(DEFAULT_TEXT, "hpo:"))
    assert (
        f"  configs/top.yaml:{methods}: hpo.upstreams: 'standard' is not in pretrain.methods "
        f"(hpo.upstreams is written at config.yaml:{hpo}, which this file's changes make wrong: "
        "set hpo.upstreams in configs/top.yaml, or add it to `unset:` there for the code's "
        "default)"
    ) in deferred_hpo, deferred_hpo
    assert "config.yaml:" not in deferred_fed.replace("written at config.yaml:", "")
    # what each target refuses with, and the warning of a run that needs neither
    raw = read_raw(top)
    assert refusal(deferred, "hpo", raw).startswith("invalid config: the `hpo` section (run by")
    assert "federated.strategies" in refusal(deferred, "validity", raw)
    assert refusal(deferred, "sweeps", raw) is None
    # the audit of the federated mechanisms reads neither the grid's upstreams nor strategies
    assert refusal(deferred, "audit", raw) is None
    assert "hpo.upstreams" in warning(deferred) and "federated.upstreams" in warning(deferred)
    # a job of the main grid loads it; the HPO's does not, naming the overlay's line
    assert load(top, sections=()).upstreams == ("mine-a", "mine-b")
    with pytest.raises(ConfigError) as info:
        load(top, sections=stage_sections("hpo"))
    assert f"configs/top.yaml:{methods}: hpo.upstreams" in str(info.value)
    assert "federated" not in str(info.value)


def test_a_main_grid_problem_the_overlay_brings_stops_it_at_the_overlays_line(overlay):
    """config.yaml's main grid and extra grids name `scratch`, `dpadapter`, ...: gone with the
    overlay's upstreams, so the main grid cannot be planned; the fix is the overlay's."""
    top = overlay(finetune="")
    with pytest.raises(ConfigError) as info:
        validate_scoped(read_raw(top), [top])
    msg = str(info.value)
    methods = _line_of(top.read_text(), "methods: [mine-a, mine-b]")
    grid = _line_of(DEFAULT_TEXT, "    - upstreams: [dpadapter]")
    assert (
        f"  configs/top.yaml:{methods}: finetune.extra_grids.0.upstreams: 'dpadapter' is not in "
        f"pretrain.methods (finetune.extra_grids.0.upstreams is written at config.yaml:{grid}"
    ) in msg, msg
    assert (
        f"  configs/top.yaml:{methods}: finetune.upstreams: 'scratch' is not in pretrain.methods"
    ) in msg, msg
    assert "hpo" not in msg and "federated" not in msg, msg


def test_a_problem_the_base_has_on_its_own_is_still_pointed_at_the_base(overlay, tmp_path):
    bad = DEFAULT_TEXT.replace("  delta: 1.0e-5\n", "  delta: 0.5\n", 1)
    (tmp_path / "config.yaml").write_text(bad)
    top = overlay()
    with pytest.raises(ConfigError) as info:
        validate_scoped(read_raw(top), [top])
    assert f"  config.yaml:{_line_of(bad, '  delta: 0.5')}: privacy.delta: 0.5" in str(info.value)


@pytest.mark.parametrize("section", SECTIONS)
def test_unset_works_for_any_section(overlay, section):
    """Every section of config.yaml can be unset by an overlay of external upstreams: its
    defaults then fit those upstreams, or, for the two every config needs, the message says so
    at the overlay's `unset:` line."""
    top = overlay(head=f"unset: [{section}]\n")
    raw = read_raw(top)
    if section in ("public", "tasks"):
        with pytest.raises(ConfigError) as info:
            validate_scoped(raw, [top])
        assert (
            f"  configs/top.yaml:3: {section}: '{section}' is a required property (removed by "
            f"`unset: [{section}]`: every config needs it)"
        ) in str(info.value)
        return
    cfg, deferred = validate_scoped(raw, [top])
    assert section not in deferred, deferred[section]
    if section in ("hpo", "federated", "sweeps", "audit"):  # its own target would run too
        load(top, sections=stage_sections(section, raw))


def test_the_default_federated_strategies_follow_the_upstreams(tiny_raw):
    """The code's default named `scratch`: a config without it failed with no line to fix."""
    tiny_raw["pretrain"] = yaml.safe_load(EXTERNAL)["pretrain"]
    assert "federated" not in tiny_raw
    assert validate(tiny_raw).federated.strategies == ("ht", "ft", "ut")
    tiny_raw["pretrain"]["methods"].append("scratch")
    assert validate(tiny_raw).federated.strategies == ("scratch", "ht", "ft", "ut")


def test_a_default_that_does_not_fit_is_named_with_its_value(overlay):
    top = overlay(head="unset: [federated]\n")
    problem = ConfigError("invalid config:\n  federated.strategies: 'scratch' needs 'scratch'")
    defaults = {"federated": {"strategies": ["scratch", "ht"]}}
    msg = str(locate(problem, [top], defaults=defaults))
    assert (
        "  configs/top.yaml:3: federated.strategies: 'scratch' needs 'scratch' (`unset: "
        "[federated]` here leaves federated.strategies to the code's default, [scratch, ht]: "
        "write federated.strategies in configs/top.yaml)"
    ) in msg, msg


def test_a_plain_config_names_a_default_with_the_line_of_the_key_its_message_names(
    tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    Path("c.yaml").write_text("seed: 0\npretrain:\n  methods: [a]\n")
    problem = ConfigError("invalid config:\n  hpo.upstreams: 'b' is not in pretrain.methods")
    msg = str(locate(problem, ["c.yaml"], defaults={"hpo": {"upstreams": ["b"]}}))
    assert (
        "  c.yaml:3: hpo.upstreams: 'b' is not in pretrain.methods (no config file writes "
        "hpo.upstreams: the code's default, [b] applies; write it in c.yaml)"
    ) in msg, msg


def test_a_job_checks_the_sections_its_stage_reads(overlay, tmp_path, capsys):
    """The merged config a job gets: a page of the report (main grid) is made; the validity
    job (HPO and federated summaries) stops before any work, naming the problems."""
    merged = tmp_path / "merged.json"
    merged.write_text(json.dumps(read_raw(overlay())))
    md = tmp_path / "t.md"
    md.write_text("| a |\n|---|\n| 1 |\n")
    page = tmp_path / "page.html"
    argv = ["--config", str(merged), "report-page", "--kind", "markdown", "--inputs", str(md)]
    argv += ["--title", "t", "--section", "finetune", "--config-names", "x", "--out", str(page)]
    assert cli.main(argv) == 0 and page.is_file()
    assert cli.main(["--config", str(merged), "validity", "--out", str(tmp_path / "v.md")]) == 2
    err = capsys.readouterr().err
    assert "hpo.upstreams: 'standard' is not in pretrain.methods" in err, err
    assert "federated.strategies: 'scratch' needs 'scratch'" in err, err
    assert not (tmp_path / "v.md").exists()
    assert stage_sections("audit", {"audit": {"federated": []}}) == ("audit",)
    assert stage_sections("audit", {})[:2] == ("audit", "federated.task")
    assert stage_sections("finetune") == () and stage_sections("sweep-figures") == ("sweeps",)


def test_an_overlay_that_narrows_the_methods_is_told_to_drop_the_label_it_no_longer_uses(
    overlay,
):
    """An external label has no code default: `unset:` "for the code's default" (issue 50)
    named a fix that is not one. The hint is what works, and it does."""
    overlay()
    narrow = Path("configs/narrow.yaml")
    head = "base: top.yaml\nresults_dir: results/narrow\n"
    body = "pretrain:\n  methods: [mine-a]\n"
    narrow.write_text(head + body)
    with pytest.raises(ConfigError) as info:
        validate_scoped(read_raw(narrow), [narrow])
    msg = str(info.value)
    written = _line_of(Path("configs/top.yaml").read_text(), "mine-b: {model")
    assert (
        "  configs/narrow.yaml:4: pretrain.external.mine-b: not in pretrain.methods, so never "
        "built: list it there or remove the entry (pretrain.external.mine-b is written at "
        f"configs/top.yaml:{written}, which this file's changes make wrong: drop it with "
        "`unset: [pretrain.external.mine-b]` in configs/narrow.yaml; an entry has no code "
        "default)"
    ) in msg, msg
    assert "code's default" not in msg, msg
    narrow.write_text(head + "unset: [pretrain.external.mine-b]\n" + body)
    cfg, _ = validate_scoped(read_raw(narrow), [narrow])
    assert cfg.upstreams == ("mine-a",) and list(cfg.external_upstreams) == ["mine-a"]


def test_a_key_the_code_has_no_default_for_gets_no_unset_advice(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("base.yaml").write_text("public: {dataset: a}\ntasks: {}\n")
    Path("top.yaml").write_text("base: base.yaml\nseed: 1\n")
    problem = ConfigError("invalid config:\n  public.dataset: 'a' is unknown")
    msg = str(locate(problem, ["top.yaml"], own=lambda raw: (None, [])))
    assert "public.dataset is written at base.yaml:1" in msg, msg
    assert msg.endswith("make wrong: set public.dataset in top.yaml)"), msg


def test_a_warning_caused_three_files_down_names_that_file_and_line(tmp_path, monkeypatch):
    """top.yaml -> mid.yaml -> low.yaml -> config.yaml, where low.yaml lowers audit.canaries
    below what config.yaml's audit.guesses need: the warning pointed at config.yaml's line of
    audit.guesses, a file no overlay wrote the cause in (issue 50). (low.yaml's `unset: [tasks]`
    takes config.yaml's mentions of its tasks along: tests/settings/test_task_refs.py.)"""
    monkeypatch.chdir(tmp_path)
    Path("config.yaml").write_text(DEFAULT_TEXT)
    Path("configs").mkdir()
    task = "    dataset: fashion-mnist\n    classes: [5, 6, 7, 8, 9]\n    n_train: 2000\n"
    Path("configs/low.yaml").write_text(
        "base: ../config.yaml\nresults_dir: results/low\nunset: [tasks]\n"
        f"tasks:\n  mine:\n{task}audit:\n  canaries: 100\n"
    )
    Path("configs/mid.yaml").write_text("base: low.yaml\nresults_dir: results/mid\n")
    top = Path("configs/top.yaml")
    top.write_text("base: mid.yaml\nresults_dir: results/top\nfinetune:\n  seeds: [0]\n")
    _, deferred = validate_scoped(read_raw(top), [top])
    assert list(deferred) == ["audit"], deferred
    audit = "\n".join(line for _, line in deferred["audit"])
    at = _line_of(DEFAULT_TEXT, "  guesses:", _line_of(DEFAULT_TEXT, "audit:"))
    assert audit.startswith("  configs/low.yaml:10: audit.guesses: every k needs 2k"), audit
    assert audit.endswith(
        f"(audit.guesses is written at config.yaml:{at}, which configs/low.yaml's changes make "
        "wrong: set audit.guesses in configs/top.yaml, or add it to `unset:` there for the "
        "code's default)"
    ), audit
    assert "config.yaml:" not in warning(deferred).replace("written at config.yaml:", "")
    # the advice works
    top.write_text(top.read_text() + "audit:\n  guesses: [20]\n")
    assert "audit" not in validate_scoped(read_raw(top), [top])[1]
