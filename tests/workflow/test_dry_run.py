"""`snakemake -n` writes nothing into the results folder (it once wrote results/.config/*.json)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import snakemake_runner  # tests/ is on sys.path
import yaml

pytestmark = pytest.mark.process

REPO = Path(__file__).resolve().parents[2]


def _dry_run(workdir: Path, *targets: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "snakemake", "-n", "--snakefile", str(REPO / "Snakefile")]
    cmd += ["--directory", str(workdir), "--cores", "1", *targets]
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{workdir / 'mlruns.db'}"}
    return snakemake_runner.run(cmd, capture_output=True, text=True, env=env, timeout=300)


def test_dry_run_writes_nothing_into_results(tmp_path, tiny_raw):
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(tiny_raw))
    r = _dry_run(tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "finetune" in r.stdout + r.stderr  # the grid was planned
    assert not (tmp_path / "results").exists(), sorted(
        p.name for p in (tmp_path / "results").rglob("*")
    )


def test_a_misspelled_variant_target_is_refused_while_planning(tmp_path, tiny_raw):
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(tiny_raw))
    r = _dry_run(tmp_path, "results/pretrain/dpadapter+gama=0.5/model.pt")
    assert r.returncode != 0
    assert "pretrain.params.dpadapter.gama: unknown parameter" in r.stdout + r.stderr
    assert not (tmp_path / "results").exists()
