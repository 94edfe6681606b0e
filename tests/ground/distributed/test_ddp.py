"""A DP job in two processes (gloo, torchrun) keeps a one-process job's guarantee (issue 39).

The tests compare what `ddp_worker.py`, launched under torchrun with two CPU processes, wrote
with the same computation made here in one process: the released clipped sum (noise
0, float64) in every per-sample mode, the noise added exactly once (a planted bug that adds it
on every rank, or on none, fails the same comparison), the replicas equal and the ledger's
epsilon that of one process, the refusals, the resume, and a crash on one rank failing the job.
Every case that ends normally runs in one launch (`launched`; a launch costs ~12 s of CPU, a
case about a second); the crash has its own.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from distributed import ddp_worker as w

REPO = Path(__file__).resolve().parents[3]


def torchrun(case: str, out: Path, *args: str, timeout: float = 240):
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'src'}{os.pathsep}{REPO / 'tests'}"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "--max-restarts=0", str(REPO / "tests/ground/distributed/ddp_worker.py"), case, str(out),
           *args]  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    return p, time.monotonic() - t0


def ranks(out: Path) -> list[dict]:
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)]


ALLOWED = ("dpsgd", "dpsat", "dpsat-momentum", "dpsam", "adpalloc")


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> list[dict]:
    """Every case that ends normally, from one launch (`ddp_worker.py all`): each rank's
    results by case."""
    out = tmp_path_factory.mktemp("all")
    p, _ = torchrun("all", out, *ALLOWED)
    assert p.returncode == 0, p.stderr[-3000:]
    return ranks(out)


@pytest.fixture
def released(launched) -> list[dict]:
    return [r["releases"] for r in launched]


@pytest.mark.process
@pytest.mark.parametrize("mode", w.MODES)
def test_noise_free_release_is_one_process_clipped_sum(released, mode):
    """Each example's clipped contribution enters the released sum once (float64)."""
    one = w.release(mode, 0.0, torch.arange(w.TOTAL), w.TOTAL)
    for r in released:
        got = r[(mode, 0.0)]
        assert torch.allclose(got, one, rtol=1e-12, atol=1e-14), (got - one).abs().max()


@pytest.mark.process
@pytest.mark.parametrize("mode", w.MODES)
def test_noise_is_added_once(released, mode):
    """The same noise draw (rank 0's generator, the one-process seed) lands once in the sum."""
    one = w.release(mode, 1.3, torch.arange(w.TOTAL), w.TOTAL)
    noise_free = w.release(mode, 0.0, torch.arange(w.TOTAL), w.TOTAL)
    assert (one - noise_free).std() > 0.5  # the noise is there at all: std 1.3 * C = 0.65
    for r in released:
        assert torch.allclose(r[(mode, 1.3)], one, rtol=1e-12, atol=1e-12)


@pytest.mark.process
def test_an_empty_local_batch_joins_the_release(released):
    one = w.release("bk", 0.0, torch.arange(5), 5)
    for r in released:
        assert torch.allclose(r["empty"], one, rtol=1e-12, atol=1e-14)


@pytest.mark.process
def test_rank_0s_noise_reaches_every_rank_when_its_own_batch_is_empty(released):
    """Rank 0 draws the noise; with its local batch empty and sigma > 0 the release is still
    the one-process one: rank 1's clipped rows plus one draw of std sigma * C."""
    one = w.release("bk", 1.3, torch.arange(5), 5)
    noise_free = w.release("bk", 0.0, torch.arange(5), 5)
    assert (one - noise_free).std() > 0.5  # the noise is there: std 1.3 * C = 0.65
    for r in released:
        got = r["empty-rank0-noisy"]
        assert torch.allclose(got, one, rtol=1e-12, atol=1e-12), (got - one).abs().max()


@pytest.mark.process
@pytest.mark.parametrize("bug", w.BUGS)
def test_the_noise_test_sees_noise_added_on_every_rank_or_on_none(launched, bug):
    """The same releases with a planted bug (made in the launch, then undone) fail the
    comparisons above."""
    got = launched[0]["planted"][bug]
    one = w.release("bk", 1.3, torch.arange(w.TOTAL), w.TOTAL)
    assert not torch.allclose(got["bk"], one, rtol=1e-6, atol=1e-6)
    # and with rank 0's own batch empty
    one = w.release("bk", 1.3, torch.arange(5), 5)
    assert not torch.allclose(got["empty-rank0-noisy"], one, rtol=1e-6, atol=1e-6)


@pytest.mark.process
@pytest.mark.parametrize("algo", ALLOWED)
def test_replicas_stay_equal_and_epsilon_is_one_process(launched, algo):
    """24 examples at q = 1/8 (expected 1.5 per rank): local batches are often empty."""
    r0, r1 = launched[0]["fit"][algo], launched[1]["fit"][algo]
    assert torch.equal(r0["weights"], r1["weights"])  # one release, one update, on both
    one = w.fit(algo, "bk", 24)
    assert r0["history"] == one["history"]  # the same (q, sigma, steps) records
    assert r0["epsilon"] == one["epsilon"] == r1["epsilon"]
    assert not torch.equal(r0["weights"], one["weights"])  # two samplers, not one: it did run


@pytest.mark.process
def test_algorithms_that_cannot_run_across_processes_are_refused(launched):
    got = launched[0]["refuse"]
    assert "cannot run in 2 processes" in got["gep"] and "anchor" in got["gep"]
    assert "cannot run in 2 processes" in got["adpclip"] and "count" in got["adpclip"]
    assert "dpsgd" in launched[0]["fit"]  # an allowed one ran in the same launch


@pytest.mark.process
def test_a_killed_job_resumes_to_the_uninterrupted_run(launched):
    """Killed after epoch 1's state was saved, resumed: each rank's sampler and RNG come back
    (rank 1's own, not rank 0's), so the weights and the ledger are the uninterrupted run's."""
    for r in (0, 1):
        resumed, whole = launched[r]["resume"], launched[r]["straight"]
        assert torch.equal(resumed["weights"], whole["weights"])
        assert resumed["history"] == whole["history"]
    assert not torch.equal(launched[0]["resume"]["weights"], w.fit("dpsgd", "bk", 48)["weights"])


@pytest.mark.process
def test_a_crash_on_one_rank_fails_the_job_without_a_hang(tmp_path):
    p, took = torchrun("crash", tmp_path, timeout=120)
    assert p.returncode != 0
    assert "planted crash on rank 1" in p.stderr + p.stdout
    assert not (tmp_path / "rank0.pt").exists()  # rank 0 never finished alone
    assert took < 90, took


@pytest.mark.process
@pytest.mark.parametrize("method", w.PRETRAIN)
def test_pre_training_in_two_processes_makes_the_one_process_updates(launched, method):
    """Warm-up's SGD, SAM's perturbation and DPAdapter's B1 gradient split over two ranks
    (pretrain.processes): the same weights as one process, up to the order of the sums."""
    one = w.pretrain(method)["weights"]
    r0, r1 = launched[0]["pretrain"][method]["weights"], launched[1]["pretrain"][method]["weights"]
    assert torch.equal(r0, r1)  # the replicas made the same updates
    assert torch.allclose(r0, one, rtol=1e-4, atol=1e-5), (r0 - one).abs().max()
    start = w.model()
    trained = torch.cat([p.detach().reshape(-1) for p in start.parameters()])
    assert not torch.allclose(one, trained)  # it trained at all


def test_a_process_without_its_own_gpu_is_told_why(monkeypatch):
    """k processes on a node that shows fewer GPUs: a clear error before any collective."""
    from dpadapter.ground import distributed

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", str(torch.cuda.device_count()))
    with pytest.raises(RuntimeError, match="needs its own GPU and this node shows"):
        distributed.init(torch.device("cuda"))
    assert not torch.distributed.is_initialized()
