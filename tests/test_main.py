"""`python -m dpadapter` ends with os._exit after main: what a normal exit does outside the
process (atexit handlers such as MLflow's flush, piped stdout) must still happen."""

import subprocess
import sys

import pytest
import yaml

pytestmark = pytest.mark.process

SCRIPT = """
import atexit, runpy, sys
atexit.register(lambda: print("atexit handler ran"))
sys.argv = ["dpadapter", "--config", sys.argv[1], "validate"]
runpy.run_module("dpadapter", run_name="__main__")
"""


def test_fast_exit_runs_atexit_and_flushes_pipes(tiny_raw, tmp_path):
    p = tmp_path / "config.yaml"
    p.write_text(yaml.safe_dump(tiny_raw))
    r = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(p)], capture_output=True, text=True, cwd=tmp_path
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["config OK", "atexit handler ran"]
