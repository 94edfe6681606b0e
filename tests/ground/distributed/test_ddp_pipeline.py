"""The tiny pipeline with `finetune.processes: 2`, run by Snakemake as a user runs it (local
jobs forked from the preforked server, each fine-tuning job under torchrun): every job ran in
two processes, wrote its files once, and released exactly what a one-process job plans, so its
epsilon is a one-process job's (issue 39)."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest
import snakemake_runner  # tests/ is on sys.path
import torch
import yaml
from tiny_config import TINY_RAW

pytestmark = pytest.mark.process

REPO = Path(__file__).resolve().parents[3]


def test_two_process_fine_tuning_jobs_in_the_tiny_pipeline(tmp_path, shared_fork_servers):
    from dpadapter.algorithms import ALGORITHMS
    from dpadapter.privacy import PrivacyLedger
    from dpadapter.settings import from_dict
    from dpadapter.train.dp_spec import run_spec

    raw = copy.deepcopy(TINY_RAW)
    raw["tasks"] = {"syn-shift": raw["tasks"]["syn-shift"]}
    raw["finetune"].update(processes=2, epsilons=[1], algorithms=["dpsgd", "dpsat"])
    raw["tracking"] = {"enabled": False}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(raw))
    cmd = [sys.executable, "-m", "snakemake", "--snakefile", str(REPO / "Snakefile"),
           "--directory", str(tmp_path), "--configfile", str(tmp_path / "config.yaml"),
           "--cores", "2"]  # fmt: skip
    # the worker's fork servers (tests/conftest.py) serve the run, as its own would
    shared = shared_fork_servers.log
    before = shared.stat().st_size if shared.is_file() else 0
    p = snakemake_runner.run(cmd, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    jobs = sorted((tmp_path / "results" / "finetune").rglob("metrics.json"))
    assert len(jobs) == 4  # 2 upstreams x 2 algorithms
    own = tmp_path / "results" / "logs" / "prefork.log"
    served = own.read_text() if own.is_file() else shared.read_bytes()[before:].decode()
    cfg = from_dict(raw)
    for path in jobs:
        m = json.loads(path.read_text())
        assert m["processes"] == 2
        assert sorted(f.name for f in path.parent.iterdir()) == ["metrics.json", "model.pt"]
        algo = m["wildcards"]["algo"]
        assert f"--algo {algo}" in served  # the job went through the fork server
        spec = run_spec(cfg, algo, 1.0, 400, m["wildcards"]["upstream"], "syn-shift")
        plan = ALGORITHMS[algo](spec, PrivacyLedger(spec.delta, spec.accountant),
                                torch.Generator()).planned_history()  # fmt: skip
        ledger = PrivacyLedger.from_state_dict(
            {"delta": spec.delta, "accountant": spec.accountant, "history": m["privacy"]["history"]}
        )
        assert ledger.history == plan
        assert m["privacy"]["epsilon"] == pytest.approx(ledger.epsilon(), rel=1e-12)
        assert m["privacy"]["epsilon"] <= 1.0
