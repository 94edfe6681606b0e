"""The conda environments of envs/ agree with the pinned pip requirements the venv is built from.

Conda channels are not reachable here, so the envs are never built in tests: these checks are
what keeps `--sdm conda` on a cluster running the same versions as the local .venv.
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
ENV_FILES = sorted((REPO / "envs").glob("*.yaml"))
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)\s*==\s*([^\s;#]+)$")


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirements() -> dict[str, str]:
    pins = {}
    for line in (REPO / "requirements.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            m = PIN.match(line)
            assert m, f"requirements.txt line is not an exact pin: {line!r}"
            pins[_norm(m.group(1))] = m.group(2)
    return pins


def _env_parts(path: Path) -> tuple[list[str], list[str]]:
    env = yaml.safe_load(path.read_text())
    conda, pip = [], []
    for dep in env["dependencies"]:
        if isinstance(dep, dict):
            pip.extend(dep.get("pip", []))
        else:
            conda.append(str(dep))
    return conda, pip


def test_there_is_an_env():
    assert ENV_FILES, "envs/*.yaml missing"


@pytest.mark.parametrize("env_file", ENV_FILES, ids=lambda p: p.name)
def test_pip_pins_agree_with_requirements(env_file):
    reqs = _requirements()
    _, pip = _env_parts(env_file)
    assert pip, "no pip section"
    for entry in pip:
        m = PIN.match(entry)
        assert m, f"{env_file.name}: pip entry {entry!r} is not an exact pin"
        name, version = _norm(m.group(1)), m.group(2)
        assert name in reqs, f"{env_file.name}: {name} is not pinned in requirements.txt"
        assert version == reqs[name], (
            f"{name}: {version} in {env_file.name}, {reqs[name]} in requirements.txt"
        )


@pytest.mark.parametrize("env_file", ENV_FILES, ids=lambda p: p.name)
def test_env_has_every_runtime_dependency(env_file):
    """Every dependency of the package (pyproject.toml) is in the env, at the pinned version."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    needed = {_norm(re.split(r"[<>=!~;\[ ]", d, maxsplit=1)[0]) for d in project["dependencies"]}
    _, pip = _env_parts(env_file)
    have = {_norm(PIN.match(e).group(1)) for e in pip if PIN.match(e)}
    assert needed <= have, f"{env_file.name} lacks {sorted(needed - have)}"


@pytest.mark.parametrize("env_file", ENV_FILES, ids=lambda p: p.name)
def test_python_matches_the_venv(env_file):
    conda, _ = _env_parts(env_file)
    pythons = [d for d in conda if re.match(r"^python\s*[=<>]", d)]
    assert pythons == [f"python={sys.version_info.major}.{sys.version_info.minor}"]


@pytest.mark.parametrize("env_file", ENV_FILES, ids=lambda p: p.name)
def test_package_is_installed_by_a_post_deploy_script(env_file):
    """Snakemake copies env files to .snakemake/conda/ first, so `-e ..` would point there."""
    _, pip = _env_parts(env_file)
    assert not [e for e in pip if e.startswith(("-e", ".", "/", "file:"))], "no local paths in pip"
    script = env_file.with_suffix(".post-deploy.sh")
    assert script.is_file(), f"{script.name} missing: the dpadapter package would not be installed"
    text = script.read_text()
    assert text.startswith("#!") and "pip install" in text and "-e" in text
