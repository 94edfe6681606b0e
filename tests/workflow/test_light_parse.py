"""Parsing the workflow and validating a config import neither torch nor Opacus nor MLflow.

Every `snakemake -n`, every malformed-config check and every workflow test pays what the parse
imports; torch and Opacus alone cost seconds. Three views of the same promise: the validation
module, every `dpadapter` module the rule files import (read from their import lines, so a new
import is covered), and a real dry run of every target, whose `-X importtime` log lists every
module the parse imported, lazy imports inside the functions it called included.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
SRC = REPO / "src"
HEAVY = ("torch", "opacus", "mlflow", "torchvision", "timm")
RULE_FILES = [REPO / "Snakefile", *sorted((REPO / "workflow" / "rules").glob("*.smk"))]
_IMPORT = re.compile(
    r"^\s*(?:from\s+(dpadapter[\w.]*)\s+import\s+([^#]+)|import\s+(dpadapter[\w.]*))"
)


def _is_module(name: str) -> bool:
    path = SRC.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def rule_file_modules() -> list[str]:
    """The dpadapter modules the rule files import (`from pkg import mod` counts as `pkg.mod`)."""
    found: list[str] = []
    for f in RULE_FILES:
        for line in f.read_text().splitlines():
            m = _IMPORT.match(line)
            if not m:
                continue
            if m.group(3):
                found.append(m.group(3))
                continue
            for alias in m.group(2).strip("() \\").split(","):
                sub = f"{m.group(1)}.{alias.split(' as ')[0].strip()}"
                found.append(sub if _is_module(sub) else m.group(1))
    return list(dict.fromkeys(found))


def heavy_after_imports(modules: list[str]) -> dict[str, list[str]]:
    """module -> the heavy packages first loaded by importing it (in order, one fresh process)."""
    code = (
        "import importlib, json, sys\n"
        f"heavy, out = {list(HEAVY)!r}, {{}}\n"
        f"for m in {modules!r}:\n"
        "    before = {h for h in heavy if h in sys.modules}\n"
        "    importlib.import_module(m)\n"
        "    out[m] = [h for h in heavy if h in sys.modules and h not in before]\n"
        "print(json.dumps(out))\n"
    )
    path = os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.process
def test_import_of_the_validation_loads_no_torch_opacus_or_mlflow():
    assert heavy_after_imports(["dpadapter.validation.compose"]) == {
        "dpadapter.validation.compose": []
    }


def test_the_rule_files_import_modules_are_found():
    """The parser of the import lines sees what the rule files import (or the next test is
    vacuous)."""
    mods = rule_file_modules()
    for expected in ("dpadapter.validation.compose", "dpadapter.upstream.resolve", "dpadapter.hpo"):
        assert expected in mods
    assert "dpadapter.audit.stage" in mods and "dpadapter.stages.report" in mods
    assert all(_is_module(m) for m in mods), mods


@pytest.mark.process
def test_no_module_the_rule_files_import_loads_torch_opacus_or_mlflow():
    found = heavy_after_imports(rule_file_modules())
    assert {m: h for m, h in found.items() if h} == {}


@pytest.mark.process
def test_a_dry_run_of_every_target_imports_no_torch_opacus_or_mlflow(tmp_path, tiny_raw):
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(tiny_raw))
    targets = ["all", "sweeps", "hpo", "audit", "federated", "validity", "report_all"]
    cmd = [sys.executable, "-X", "importtime", "-m", "snakemake", "-n", "--cores", "1"]
    cmd += ["--snakefile", str(REPO / "Snakefile"), "--directory", str(tmp_path), *targets]
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlruns.db'}"}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "audit_run" in r.stdout and "hpo" in r.stdout  # the optional grids were planned
    imported = re.findall(r"^import time:\s+\d+ \|\s+\d+ \|\s*(\S+)$", r.stderr, re.M)
    assert "dpadapter.validation.compose" in imported  # the log is what it should be
    assert sorted({m for m in imported if m.split(".")[0] in HEAVY}) == []
