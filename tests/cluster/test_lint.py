"""`snakemake --lint` finds nothing in the workflow (run on the tiny config, in a temp dir)."""

from __future__ import annotations

import re
import subprocess

import pytest
from cluster_helpers import REPO, VENV_BIN, job_env, tiny_workdir


@pytest.mark.slow
def test_snakemake_lint_is_clean(tiny_raw, tmp_path):
    wd = tiny_workdir(tmp_path, tiny_raw)
    r = subprocess.run(
        [str(VENV_BIN / "snakemake"), "--lint",
         "--snakefile", str(REPO / "Snakefile"), "--directory", str(wd)],
        cwd=wd, env=job_env(wd), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    out = r.stdout + r.stderr
    # one "Lints for rule X (...)" / "Lints for snakefile F" header per linted item, then "* title"
    problems = re.findall(r"^Lints for (.+?):?\n((?:\s+\*.*\n|\s{6}.*\n)+)", out, re.M)
    summary = [
        f"{where}: {t.strip().rstrip(':')}"
        for where, body in problems
        for t in re.findall(r"\* (.*)", body)
    ]
    assert not summary, "snakemake --lint:\n" + "\n".join(summary)
    assert r.returncode == 0, out[-3000:]
