"""dvc_sync on a two-stage DVC project (no Snakemake): pulled outputs that match dvc.lock are put
into build order; an output that differs from the lock is left for Snakemake to re-build; the
commit records only stages whose outputs the finished run covers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dpadapter.workflow import dvc_sync

DVC_YAML = {
    "stages": {
        "a": {"cmd": "true", "outs": [{"res/a.txt": {"persist": True}}]},
        "b": {"cmd": "true", "deps": ["res/a.txt"], "outs": [{"res/b.txt": {"persist": True}}]},
    }
}


def _project(tmp_path: Path, monkeypatch) -> Path:
    monkeypatch.delenv("DVC_STAGE", raising=False)
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run([sys.executable, "-m", "dvc", "init", "-q"], cwd=tmp_path, check=True)
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump(DVC_YAML))
    (tmp_path / "res").mkdir()
    (tmp_path / "res" / "a.txt").write_text("upstream\n")
    (tmp_path / "res" / "b.txt").write_text("built from upstream\n")
    return tmp_path


def _age(path: Path, seconds_ago: float) -> None:
    t = os.path.getmtime(path) - seconds_ago
    os.utime(path, (t, t))


@pytest.mark.process
def test_commit_then_restore_only_what_matches_the_lock(tmp_path, monkeypatch):
    wd = _project(tmp_path, monkeypatch)
    # a run that built only a/ records only stage a; one that covers both records both
    assert dvc_sync.commit("res", ["res/a.txt"], wd) == ["a"]
    assert dvc_sync.commit("res", ["res/a.txt", "res/b.txt"], wd) == ["a", "b"]
    lock = yaml.safe_load((wd / "dvc.lock").read_text())["stages"]
    assert set(lock) == {"a", "b"}

    a, b = wd / "res" / "a.txt", wd / "res" / "b.txt"
    _age(b, 120)  # as after a pull: the output older than its input
    assert dvc_sync.restore_build_order("res", wd) == ["b"]
    assert b.stat().st_mtime > a.stat().st_mtime
    assert dvc_sync.restore_build_order("res", wd) == []  # in order now: nothing to do

    a.write_text("re-trained upstream\n")  # a real change: b must stay outdated
    _age(b, 120)
    assert dvc_sync.restore_build_order("res", wd) == []
    assert b.stat().st_mtime < a.stat().st_mtime


def test_nothing_happens_outside_a_dvc_project(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "res").mkdir()
    assert dvc_sync.restore_build_order("res") == []
    assert dvc_sync.commit("res", []) == []
