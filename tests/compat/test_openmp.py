"""`OMP_WAIT_POLICY=PASSIVE` for every process that imports dpadapter before torch
(dpadapter.compat.openmp): idle OpenMP threads of jobs that share cores sleep, not spin."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from dpadapter.compat import openmp
from dpadapter.launch import prefork

SHOW = (
    "import os, sys; import dpadapter; assert 'torch' not in sys.modules; "
    "print(os.environ.get('OMP_WAIT_POLICY'))"
)


@pytest.mark.parametrize(("given", "seen"), [(None, "PASSIVE"), ("ACTIVE", "ACTIVE")])
def test_importing_the_package_sets_passive_before_torch_and_keeps_a_users_choice(given, seen):
    env = {k: v for k, v in os.environ.items() if k != openmp.VARIABLE}
    if given is not None:
        env[openmp.VARIABLE] = given
    # -S: no site-packages .pth (the venv's imports dpadapter at start), so the import is ours
    code = f"import sys; sys.path[:0] = {sys.path!r}; {SHOW}"
    out = subprocess.run([sys.executable, "-S", "-c", code], env=env, capture_output=True,
                         text=True, check=True).stdout  # fmt: skip
    assert out.split() == [seen]


def test_a_job_of_another_wait_policy_is_not_forked_from_a_server():
    """Read when torch loads: a server's children keep the server's, so a job asking for
    another one must run in its own process (the identity check, `prefork._identity`)."""
    assert openmp.VARIABLE in prefork.LOAD_TIME_ENV
    assert prefork._identity()["load_time_env"][openmp.VARIABLE] == os.environ.get(openmp.VARIABLE)
