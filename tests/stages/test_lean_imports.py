"""A job imports only what it uses: non-private stages never import Opacus, no stage imports
MLflow with tracking off, and timm / torchvision only where a timm model is built or a dataset
decoded. Each check runs in a fresh interpreter and reads its `sys.modules`.

(The config validation a job runs first is left out here: `dpadapter.validation.compose` has its own
import test.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.process

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("opacus", "mlflow", "timm", "torchvision", "torch._dynamo", "pandas")


def _loaded_after(code: str, tmp_path: Path) -> set[str]:
    """The HEAVY modules in sys.modules after `code` ran in a fresh interpreter."""
    listed = f"[m for m in {HEAVY!r} if m in sys.modules]"
    probe = f"{code}\nimport json, sys\nprint(json.dumps({listed}))"
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT / 'tests'}"}
    out = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


NON_PRIVATE = [
    "dpadapter.stages.warmup",
    "dpadapter.stages.pretrain",
    "dpadapter.stages.aggregate",
    "dpadapter.stages.figures",
    "dpadapter.stages.reference",
    "dpadapter.stages.table_so_far",
    "dpadapter.stages.report",
    "dpadapter.stages.validity",
    "dpadapter.train.loops",
    "dpadapter.upstream",
    "dpadapter.models",
    "dpadapter.data",
]


@pytest.mark.parametrize("module", NON_PRIVATE)
def test_non_private_modules_import_no_opacus_mlflow_timm(module, tmp_path):
    assert _loaded_after(f"import {module}", tmp_path) == set()


_CFG = """
from pathlib import Path
from dpadapter.settings import from_dict
from tiny_config import TINY_RAW
raw = dict(TINY_RAW, results_dir="results", tracking={{"experiment": "t", "enabled": False}})
raw["finetune"] = dict(raw["finetune"], epochs=1)
cfg = from_dict(raw)
{body}
"""


def test_warmup_and_pretrain_jobs_import_no_opacus_and_no_mlflow(tmp_path):
    body = """
from dpadapter.stages import pretrain, warmup
warmup.run(cfg, Path("w"))
pretrain.run(cfg, "standard", Path("p"), Path("w/model.pt"))
pretrain.run(cfg, "scratch", Path("s"), None)
assert Path("p/metrics.json").is_file() and Path("s/model.pt").is_file()
"""
    # torch._dynamo: torch.optim's first param group imports it (`torch._disable_dynamo`), in
    # every training job whatever this repository does
    assert _loaded_after(_CFG.format(body=body), tmp_path) == {"torch._dynamo"}


def test_a_finetune_job_with_tracking_off_imports_no_mlflow(tmp_path):
    body = """
from dpadapter.stages import finetune, pretrain
pretrain.run(cfg, "scratch", Path("s"), None)
finetune.run(cfg, "scratch", "syn-same", "dpsgd", 4.0, 0, Path("s/model.pt"), Path("f"))
assert Path("f/metrics.json").is_file()
"""
    # Opacus is the DP step's (torch._dynamo torch.optim's); MLflow, timm, torchvision and
    # pandas are not needed
    assert _loaded_after(_CFG.format(body=body), tmp_path) == {"opacus", "torch._dynamo"}
