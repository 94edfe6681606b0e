"""bench/cpu/everyday.py: old beside new, its table from each revision's timed commands (the
commands themselves replaced: the real ones take 45 minutes)."""

from __future__ import annotations

import json

import pytest
from bench_scripts import import_bench

pytestmark = pytest.mark.process


@pytest.fixture
def everyday(monkeypatch, tmp_path):
    mod = import_bench("everyday")
    walls = {("run", "old1"): 400.0, ("run", "new2"): 300.0, ("test", "old1"): 800.0,
             ("test", "new2"): 600.0}  # fmt: skip

    def clone(rev, into):
        (into / "results").mkdir(parents=True)
        return into

    def timed(cmd, cwd, log):
        what, rev = cwd.name.split("-", 1)
        log.write_text("1769 passed, 19 skipped in 800.00s\n")
        return walls[(what, rev)], 0

    monkeypatch.setattr(mod, "_clone", clone)
    monkeypatch.setattr(mod, "_timed", timed)
    return mod


def test_both_commands_old_beside_new(everyday, tmp_path, capsys):
    out = tmp_path / "figures.json"
    assert everyday.main(["old1", "new2", "--work", str(tmp_path / "w"), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| make run | 400.0 s | 300.0 s | 0.75 |" in text
    assert "| make test | 800.0 s | 600.0 s | 0.75 |" in text
    assert "make test of new2: 1769 passed" in text
    data = json.loads(out.read_text())
    assert [r["rev"] for r in data["results"]] == ["old1", "new2"]
    assert data["results"][1]["run"]["how"] == "fresh clone, set-up included"


def test_one_command_and_a_failure_is_said(everyday, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(
        everyday, "_timed", lambda cmd, cwd, log: (log.write_text("x\n"), (5.0, 2))[1]
    )
    assert everyday.main(["old1", "new2", "--only", "run", "--work", str(tmp_path / "w")]) == 1
    text = capsys.readouterr().out
    assert "| make run | 5.0 s | 5.0 s | 1.00 (exit 2 / 2) |" in text
    assert "make test" not in text.split("\n\n")[1]
