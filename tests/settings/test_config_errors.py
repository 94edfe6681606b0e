"""Config errors a person can act on: a key written twice is refused naming both lines, and
every problem names the user's file, the key and its line, once (issue 27, item 4)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import snakemake_runner  # tests/ is on sys.path

from dpadapter.settings import ConfigError, key_lines, read_raw
from dpadapter.validation.compose import load, validate_files

REPO = Path(__file__).resolve().parents[2]
DEFAULT_TEXT = (REPO / "config.yaml").read_text()


def _line_of(text: str, needle: str, start: int = 1) -> int:
    """1-based number of the first line at or after `start` that contains `needle`."""
    for i, line in enumerate(text.splitlines(), 1):
        if i >= start and needle in line:
            return i
    raise AssertionError(f"{needle!r} not in the text")


def _with_line_after(text: str, after: str, new: str) -> str:
    """`text` with the line `new` inserted below the first line that starts with `after`."""
    lines = text.splitlines(keepends=True)
    i = next(i for i, line in enumerate(lines) if line.startswith(after))
    return "".join(lines[: i + 1] + [new + "\n"] + lines[i + 1 :])


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_a_duplicate_key_is_refused_naming_both_lines(in_tmp):
    text = _with_line_after(DEFAULT_TEXT, "  seeds: [0, 1, 2]", "  epsilons: [8]")
    (in_tmp / "dup.yaml").write_text(text)
    first = _line_of(text, "  epsilons: [1, 4]")
    second = _line_of(text, "  epsilons: [8]")
    for read in (read_raw, load):
        with pytest.raises(ConfigError) as info:
            read("dup.yaml")
        msg = str(info.value)
        assert f"dup.yaml:{second}: finetune.epsilons: duplicate key" in msg, msg
        assert f"(first at line {first})" in msg, msg


def test_duplicates_inside_lists_and_at_the_top_level_are_found(in_tmp):
    p = in_tmp / "c.yaml"
    p.write_text("a:\n  - x: 1\n    y: 2\n    x: 3\nb: 1\n")
    with pytest.raises(ConfigError, match=r"c\.yaml:4: a\.0\.x: duplicate key \(first at line 2\)"):
        key_lines(p)
    p.write_text("a: {x: 1}\nb: 1\nb: 2\n")
    with pytest.raises(ConfigError, match=r"c\.yaml:3: b: duplicate key \(first at line 2\)"):
        key_lines(p)
    p.write_text("a:\n  x: 1\nb:\n  x: 2\n")  # the same name in two mappings is no duplicate
    assert key_lines(p) == {"a": 1, "a.x": 2, "b": 3, "b.x": 4}


def test_a_duplicate_key_in_a_json_config_is_refused(in_tmp):
    (in_tmp / "c.json").write_text('{"seed": 0, "seed": 1}')
    with pytest.raises(ConfigError, match=r"c\.json: seed: duplicate key"):
        read_raw("c.json")


def test_a_schema_violation_names_the_file_the_key_and_its_line(in_tmp):
    text = DEFAULT_TEXT.replace("  epochs: 8\n", '  epochs: "8"\n', 1)
    text = text.replace("  noise_std: 0.05\n", "  noise_sd: 0.05\n", 1)
    (in_tmp / "bad.yaml").write_text(text)
    with pytest.raises(ConfigError) as info:
        load("bad.yaml")
    lines = str(info.value).splitlines()
    epochs = _line_of(text, '  epochs: "8"', _line_of(text, "finetune:"))
    noise = _line_of(text, "  noise_sd: 0.05")
    assert lines[0] == "invalid config:"
    assert f"  bad.yaml:{epochs}: finetune.epochs: '8' is not of type 'integer'" in "\n".join(
        lines
    ), lines
    assert any(
        line.startswith(f"  bad.yaml:{noise}: robustness.noise_sd: unknown key") for line in lines
    ), lines


def test_a_cross_field_problem_points_at_the_key_or_its_section(in_tmp):
    """A key the file does not write (a default) is pointed at its nearest section."""
    text = DEFAULT_TEXT.replace("  delta: 1.0e-5\n", "  delta: 0.5\n", 1)
    text = text.replace("  upstreams: [standard]   #", "  upstreams: [nope]   #", 1)
    (in_tmp / "c.yaml").write_text(text)
    with pytest.raises(ConfigError) as info:
        load("c.yaml")
    msg = str(info.value)
    assert f"  c.yaml:{_line_of(text, '  delta: 0.5')}: privacy.delta: 0.5 is not below" in msg
    fed = _line_of(text, "  upstreams: [nope]")
    assert f"  c.yaml:{fed}: federated.upstreams: 'nope' is not in pretrain.methods" in msg, msg


def test_later_files_and_command_line_overrides_are_named(in_tmp):
    base = in_tmp / "base.yaml"
    base.write_text(DEFAULT_TEXT)
    top = in_tmp / "top.yaml"
    top.write_text("finetune:\n  epochs: zero\n")
    raw = read_raw(base)
    raw["finetune"] = {**raw["finetune"], "epochs": "zero"}
    raw["seed"] = "x"
    with pytest.raises(ConfigError) as info:
        validate_files(raw, [base, top], overrides={"seed": "x"})
    msg = str(info.value)
    assert "  top.yaml:2: finetune.epochs: 'zero' is not of type 'integer'" in msg, msg
    assert "  --config: seed: 'x' is not of type 'integer'" in msg, msg


def _dry_run(tmp_path: Path, configfile: Path) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable, "-m", "snakemake", "-n", "--cores", "1",
        "--snakefile", str(REPO / "Snakefile"), "--directory", str(tmp_path),
        "--configfile", configfile.name,
    ]  # fmt: skip
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlruns.db'}"}
    return snakemake_runner.run(
        cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env
    )


@pytest.mark.slow
def test_snakemake_prints_each_problem_once_with_the_users_file_and_line(tmp_path):
    text = DEFAULT_TEXT.replace("results_dir: results\n", f"results_dir: {tmp_path / 'r'}\n")
    bad = text.replace("  epochs: 8\n", '  epochs: "8"\n', 1)
    (tmp_path / "bad.yaml").write_text(bad)
    r = _dry_run(tmp_path, tmp_path / "bad.yaml")
    out = r.stdout + r.stderr
    assert r.returncode != 0
    line = _line_of(bad, '  epochs: "8"', _line_of(bad, "finetune:"))
    problem = f"bad.yaml:{line}: finetune.epochs: '8' is not of type 'integer'"
    assert out.count(problem) == 1, out[-3000:]
    assert out.count("finetune.epochs") == 1, out[-3000:]
    assert "common.smk" not in out and "Traceback" not in out, out[-3000:]
    assert not (tmp_path / "r").exists()

    dup = _with_line_after(text, "  seeds: [0, 1, 2]", "  epsilons: [8]")
    (tmp_path / "dup.yaml").write_text(dup)
    r = _dry_run(tmp_path, tmp_path / "dup.yaml")
    out = r.stdout + r.stderr
    assert r.returncode != 0
    first, second = _line_of(dup, "  epsilons: [1, 4]"), _line_of(dup, "  epsilons: [8]")
    found = re.findall(
        r"dup\.yaml:(\d+): finetune\.epsilons: duplicate key \(first at line (\d+)\)", out
    )
    assert found == [(str(second), str(first))], out[-3000:]
    assert not (tmp_path / "r").exists()


def test_the_schema_reads_the_same_with_either_yaml_parser():
    """`base_schema` takes libyaml's parser where PyYAML has it (for speed); the tree must be
    the pure-Python parser's, or a job would validate against another schema than the docs'."""
    import yaml

    from dpadapter.settings import base_schema, schema

    assert base_schema() == yaml.load(schema.SCHEMA_PATH.read_text(), Loader=yaml.SafeLoader)
    if yaml.__with_libyaml__:
        assert schema._SAFE_LOADER is yaml.CSafeLoader


def test_the_parse_memo_hands_out_copies_and_sees_an_edit(in_tmp):
    """A text's parse is memoised (settings/files.py): a caller that changes what it got must
    not change the next read, and an edited file (another text) is parsed again, its
    duplicate refused though the text before it was read cleanly."""
    p = in_tmp / "c.yaml"
    p.write_text("finetune:\n  epsilons: [1, 4]\n")
    first = read_raw(p)
    first["finetune"]["epsilons"].append(8)
    assert read_raw(p)["finetune"]["epsilons"] == [1, 4]
    lines = key_lines(p)
    lines["finetune"] = 99
    assert key_lines(p)["finetune"] == 1
    p.write_text("finetune:\n  epsilons: [2]\n")
    assert read_raw(p)["finetune"]["epsilons"] == [2]
    p.write_text("finetune:\n  epsilons: [2]\n  epsilons: [3]\n")
    with pytest.raises(ConfigError, match=r"c\.yaml:3: finetune\.epsilons: duplicate key"):
        read_raw(p)


def test_libyaml_and_pure_python_parsers_read_every_shipped_config_alike():
    """The memo parses with libyaml's parser where PyYAML has it: the documents and the line
    maps must be what the pure-Python parser gives, for every config the project ships."""
    import yaml

    from dpadapter.settings import files

    paths = [REPO / "config.yaml", *sorted((REPO / "configs").rglob("*.yaml"))]
    for path in paths:
        text = path.read_text()
        fast = files._parsed.__wrapped__(text)
        loader = files._LOADER
        try:
            files._LOADER = yaml.SafeLoader
            slow = files._parsed.__wrapped__(text)
        finally:
            files._LOADER = loader
        assert fast == slow, path
