"""`finetune.processes: 2` through the command line: the job re-launches itself under torchrun,
rank 0 writes its files once, and its privacy record is a one-process job's (issue 39)."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from tiny_config import TINY_HPO, TINY_RAW

from dpadapter.launch import prefork

REPO = Path(__file__).resolve().parents[3]
# A one-process job is forked from the worker's fork server (tests/conftest.py) as a local
# run's jobs are: it sees one thread, as Snakemake's training rules give it; a two-process one
# re-launches itself under torchrun from there (as in
# tests/ground/distributed/test_ddp_pipeline.py).
pytestmark = [pytest.mark.process, pytest.mark.usefixtures("module_fork_servers")]


def _run(config: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), **prefork.thread_env(1)}
    cmd = [sys.executable, "-m", "dpadapter", "--config", str(config), *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)


def _config(tmp_path: Path, processes: int, **finetune) -> Path:
    raw = copy.deepcopy(TINY_RAW)
    raw.update(results_dir=str(tmp_path / f"results{processes}"), device="cpu")
    raw["tracking"] = {"enabled": False}
    raw["finetune"].update(processes=processes, **finetune)
    path = tmp_path / f"config{processes}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_two_processes_give_one_process_privacy_and_one_set_of_files(tmp_path):
    ckpt_dir = tmp_path / "pretrain"
    p = _run(_config(tmp_path, 1), "pretrain", "--method", "scratch", "--out", str(ckpt_dir))
    assert p.returncode == 0, p.stderr[-3000:]
    job = ["--upstream", "scratch", "--task", "syn-shift", "--algo", "dpsat", "--eps", "1"]
    job += ["--seed", "0", "--ckpt", str(ckpt_dir / "model.pt")]
    got = {}
    for k in (1, 2):
        out = tmp_path / f"job{k}"
        p = _run(_config(tmp_path, k), "finetune", *job, "--out", str(out))
        assert p.returncode == 0, p.stderr[-4000:]
        assert sorted(f.name for f in out.iterdir()) == ["metrics.json", "model.pt"]
        got[k] = json.loads((out / "metrics.json").read_text())
        assert got[k]["processes"] == k  # it did run in k processes
        assert p.stdout.count("test accuracy") == 1  # rank 0's line only
    one, two = got[1]["privacy"], got[2]["privacy"]
    # the same history; the float's last bits may follow the thread count (torchrun sets one)
    assert two["epsilon"] == pytest.approx(one["epsilon"], rel=1e-12) and two["epsilon"] <= 1.0
    assert two["history"] == one["history"] and two["steps"] == one["steps"]
    assert two["sample_rate"] == one["sample_rate"]


def test_a_config_asking_processes_for_a_refused_algorithm_fails_before_any_job(tmp_path):
    p = _run(_config(tmp_path, 2, algorithms=["dpsgd", "gep"]), "validate")
    assert p.returncode == 2
    assert "finetune.processes: 2 processes cannot run 'gep'" in p.stderr
    ok = _run(_config(tmp_path, 2, algorithms=["dpsgd", "dpsat"]), "validate")
    assert ok.returncode == 0, ok.stderr


@pytest.mark.parametrize("bad", [0, -1, 1.5])
def test_processes_must_be_a_positive_integer(tmp_path, bad):
    p = _run(_bad(tmp_path, bad), "validate")
    assert p.returncode == 2 and "processes" in p.stderr


def _bad(tmp_path: Path, value) -> Path:
    raw = copy.deepcopy(TINY_RAW)
    raw["finetune"]["processes"] = value
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_an_hpo_trial_in_two_processes_keeps_its_planned_releases(tmp_path):
    """The HPO's trials train through the same loop: with processes: 2 a trial's ledger is
    still its plan's (the trial itself refuses otherwise) and one metrics.json is written."""
    configs = {}
    for k in (1, 2):
        raw = copy.deepcopy(TINY_RAW)
        raw.update(results_dir=str(tmp_path / "results"), device="cpu", hpo=TINY_HPO)
        raw["privacy"]["accountant"] = "rdp"
        raw["tracking"] = {"enabled": False}
        raw["finetune"]["processes"] = k
        configs[k] = tmp_path / f"hpo{k}.yaml"
        configs[k].write_text(yaml.safe_dump(raw))
    ckpt = tmp_path / "pretrain"
    p = _run(configs[1], "pretrain", "--method", "scratch", "--out", str(ckpt))
    assert p.returncode == 0, p.stderr[-3000:]
    plan = tmp_path / "plan.json"
    p = _run(configs[1], "hpo", "plan", "--upstream", "scratch", "--task", "syn-shift",
             "--algo", "dpsgd", "--seed", "0", "--out", str(plan))  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    got = {}
    for k in (1, 2):
        out = tmp_path / f"trial{k}"
        p = _run(configs[k], "hpo", "trial", "--plan", str(plan), "--sweep", "1", "--trial", "0",
                 "--ckpt", str(ckpt / "model.pt"), "--out", str(out))  # fmt: skip
        assert p.returncode == 0, p.stderr[-4000:]
        assert sorted(f.name for f in out.iterdir()) == ["metrics.json"]
        got[k] = json.loads((out / "metrics.json").read_text())
        assert got[k]["processes"] == k
    assert got[2]["privacy"]["history"] == got[1]["privacy"]["history"]
    assert got[2]["privacy"]["epsilon"] == pytest.approx(got[1]["privacy"]["epsilon"], rel=1e-12)


def test_a_warm_up_job_in_two_processes_trains_the_one_process_weights(tmp_path):
    """pretrain.processes: 2 re-launches a warm-up job under torchrun; rank 0 writes its files
    once and the weights are one process's up to the order of the sums."""
    import torch

    weights = {}
    for k in (1, 2):
        raw = copy.deepcopy(TINY_RAW)
        raw.update(results_dir=str(tmp_path / f"results{k}"), device="cpu")
        raw["tracking"] = {"enabled": False}
        raw["pretrain"]["processes"] = k
        config = tmp_path / f"warm{k}.yaml"
        config.write_text(yaml.safe_dump(raw))
        out = tmp_path / f"warmup{k}"
        p = _run(config, "warmup", "--out", str(out))
        assert p.returncode == 0, p.stderr[-4000:]
        assert sorted(f.name for f in out.iterdir()) == ["metrics.json", "model.pt"]
        assert json.loads((out / "metrics.json").read_text())["processes"] == k
        state = torch.load(out / "model.pt", weights_only=False)["state_dict"]
        weights[k] = torch.cat([v.reshape(-1).double() for v in state.values()])
    assert torch.allclose(weights[2], weights[1], rtol=1e-3, atol=1e-4)
