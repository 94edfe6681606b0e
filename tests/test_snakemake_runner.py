"""tests/snakemake_runner.py: a Snakemake call forked from the preloaded server ends as the same
call in a fresh `python -m snakemake` process does (status, streams, folder, environment)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import snakemake_runner  # tests/ is on sys.path

pytestmark = pytest.mark.process

SNAKEFILE = """
if config.get("refuse"):
    raise SystemExit("refused: " + config["refuse"])

rule all:
    input: "out.txt"

rule make:
    output: "out.txt"
    shell: "echo {config[word]} $MARK > {output}"
"""


def _both(tmp_path, *args: str, **env: str) -> list[subprocess.CompletedProcess]:
    out = []
    for way in ("fresh", "forked"):
        folder = tmp_path / way
        folder.mkdir()
        (folder / "Snakefile").write_text(SNAKEFILE)
        cmd = [sys.executable, "-m", "snakemake", "--cores", "1", *args]
        call = subprocess.run if way == "fresh" else snakemake_runner.run
        full_env = {**os.environ, **env}
        out.append(call(cmd, capture_output=True, text=True, env=full_env, cwd=folder, timeout=120))
    return out


@pytest.fixture(autouse=True)
def _forking(monkeypatch):
    monkeypatch.delenv(snakemake_runner.OFF, raising=False)
    assert snakemake_runner._server() is not None, "no forkserver on this platform"


def test_a_run_uses_the_calls_folder_and_environment(tmp_path):
    fresh, forked = _both(tmp_path, "--config", "word=hello", MARK="m4rk")
    for r in (fresh, forked):
        assert r.returncode == 0, r.stderr[-2000:]
        assert "2 of 2 steps (100%) done" in r.stderr
    assert (tmp_path / "fresh" / "out.txt").read_text() == "hello m4rk\n"
    assert (tmp_path / "forked" / "out.txt").read_text() == "hello m4rk\n"


def test_a_workflow_that_exits_with_a_message_prints_it_and_fails(tmp_path):
    fresh, forked = _both(tmp_path, "-n", "--config", "word=x", "refuse=why")
    assert fresh.returncode == forked.returncode == 1
    assert "refused: why" in fresh.stderr and "refused: why" in forked.stderr


def test_a_bad_argument_is_refused_alike(tmp_path):
    fresh, forked = _both(tmp_path, "--no-such-option")
    assert fresh.returncode == forked.returncode == 2
    assert "unrecognized arguments: --no-such-option" in forked.stderr
    assert fresh.stderr.splitlines()[-1] == forked.stderr.splitlines()[-1]


def test_anything_else_runs_as_its_own_process(tmp_path):
    r = snakemake_runner.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    assert r.returncode == 0 and int(r.stdout) != os.getpid()
