"""Shared fixtures: a tiny config on synthetic data, so tests run the real code in seconds."""

from __future__ import annotations

import os

# Idle OpenMP threads sleep instead of spinning, in this process and every one it starts (set
# before anything loads torch, whose GNU OpenMP reads it once). The suite runs two workers on two
# cores, so one worker's torch threads (two where a test does not pin one) wait on a core the
# other is using; by default libgomp spins there first. Measured on this 2-core machine (vm,
# 2026-11-28): a tiny fine-tuning job with two threads beside a busy loop took 15.3 and 16.8 s
# of user CPU by default, 6.1 and 6.0 s with PASSIVE. The policy changes when a thread sleeps,
# not how work is split: the same bits (`make run` gave byte-identical checkpoints with it).
# Not the pipeline's default: a two-thread job alone on two cores waits longer to wake
# (`make run`'s warm-up 6.6 -> 12.4 s of training). A value already set is kept.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import copy  # noqa: E402
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest

import dpadapter  # noqa: F401  (registers torchvision op schemas before anything imports it)

REPO = Path(__file__).resolve().parents[1]

import process_guard  # noqa: E402  (tests/ is on sys.path)
from longest_first import make_scheduler  # noqa: E402
from repo_guard import mlflow_footprint  # noqa: E402
from tiny_config import TINY_RAW  # noqa: E402


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist, absent without it
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") == "loadfile":
        return make_scheduler(config, log)
    return None


def pytest_configure(config):
    process_guard.install()


# A test in `make check`'s tier (marked neither `process` nor `slow`) fails when it starts a
# process, in its fixtures too, whichever command runs it (tests/process_guard.py).
@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    return (yield) if process_guard.in_full_tier_only(item) else (yield from _guarded(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    return (yield) if process_guard.in_full_tier_only(item) else (yield from _guarded(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item):
    return (yield) if process_guard.in_full_tier_only(item) else (yield from _guarded(item))


def _guarded(item):
    with process_guard.guarding(item.nodeid):
        return (yield)


@pytest.fixture
def tiny_raw() -> dict:
    return copy.deepcopy(TINY_RAW)


@pytest.fixture(scope="session")
def _empty_mlflow_store(tmp_path_factory) -> Path:
    """An MLflow sqlite store as MLflow creates it on first use, made once per worker.

    Creating one runs MLflow's schema migrations (about a second of CPU, several of wall time
    on a busy disk: a commit each); the in-process stage tests each start from a copy instead
    (`empty_mlflow_store`).
    The race on creating a store is tested on its own (tests/cluster/test_mlflow_load.py).
    None where MLflow is not installed (a bare GPU image: bench/gpu/gpu_session.sh runs the CUDA
    tests there), where tracking switches itself off (`tracking.enabled: auto`).
    """
    try:
        from mlflow import MlflowClient
    except ImportError:
        return None

    db = tmp_path_factory.mktemp("mlflow-template") / "mlruns.db"
    MlflowClient(tracking_uri=f"sqlite:///{db}").search_experiments()
    return db


@pytest.fixture
def empty_mlflow_store(tmp_path, _empty_mlflow_store) -> Path:
    """tmp_path/mlruns.db (the test's store, see `_track_into_tmp`) made, as MLflow would."""
    if _empty_mlflow_store is not None:
        shutil.copyfile(_empty_mlflow_store, tmp_path / "mlruns.db")
    return tmp_path / "mlruns.db"


@pytest.fixture
def tiny_cfg(tiny_raw, tmp_path, monkeypatch, empty_mlflow_store):
    """Validated tiny config whose results, data and MLflow store live under tmp_path."""
    from dpadapter.settings import from_dict

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlruns.db'}")
    return from_dict(tiny_raw)


class ForkServers(NamedTuple):
    env: str  # the value of DPADAPTER_PREFORK that names them ("" where switched off)
    log: Path  # what they served, a line per job

    def job_env(self, threads: int | str) -> dict[str, str]:
        """The variables that send a job of `threads` threads run outside Snakemake (a local
        reference job, a script's stage process) to the server of its count: its thread
        variables as Snakemake sets them, and the servers where they are up. A server of
        another count refuses the job, which then runs in its own process."""
        from dpadapter.launch import prefork

        env = {"DPADAPTER_THREADS": str(threads), **prefork.thread_env(threads)}
        return {**env, prefork.ENV: self.env} if self.env else env


@pytest.fixture(scope="session")
def _fork_servers(tmp_path_factory) -> ForkServers:
    """Fork servers (`dpadapter.launch.prefork`) for 1 and 2 threads, started once per xdist worker.

    Each Snakemake run of the workflow starts servers of its own, which import torch, Opacus
    and MLflow (~5 s of CPU each, two per run); the end-to-end tests make a few dozen runs. A
    run finds these in `DPADAPTER_PREFORK` (`shared_fork_servers`) and uses them instead
    (`prefork.inherited`); its jobs are forked exactly as from its own
    (tests/launch/test_prefork.py).
    The tiny pipeline's test keeps starting its own, and checks that it does.
    """
    from dpadapter.launch import prefork

    log = tmp_path_factory.mktemp("fork-servers") / "prefork.log"
    started = (prefork.start(sys.executable, log, threads=k, idle_seconds=7200) for k in (1, 2))
    env = os.pathsep.join(p for p in started if p)
    yield ForkServers(env, log)
    prefork.stop(env)


@pytest.fixture
def shared_fork_servers(_fork_servers, monkeypatch) -> ForkServers:
    """The worker's fork servers in this test's environment (its Snakemake runs use them)."""
    from dpadapter.launch import prefork

    if _fork_servers.env:
        monkeypatch.setenv(prefork.ENV, _fork_servers.env)
    return _fork_servers


@pytest.fixture(scope="module")
def module_fork_servers(_fork_servers) -> Iterator[ForkServers]:
    """`shared_fork_servers` for a whole module, its module-scoped runs included
    (`pytestmark = pytest.mark.usefixtures("module_fork_servers")`)."""
    from dpadapter.launch import prefork

    with pytest.MonkeyPatch.context() as mp:
        if _fork_servers.env:
            mp.setenv(prefork.ENV, _fork_servers.env)
        yield _fork_servers


@pytest.fixture(autouse=True)
def _single_thread(monkeypatch):
    monkeypatch.setenv("DPADAPTER_THREADS", os.environ.get("DPADAPTER_THREADS", "1"))


@pytest.fixture(autouse=True)
def _track_into_tmp(monkeypatch, tmp_path):
    """No test writes MLflow runs into the checkout's results/ (the user's own runs): every test
    starts with a store of its own, and one that still wrote there fails, named."""
    uri = f"sqlite:///{tmp_path / 'mlruns.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    # An earlier test of this worker that ran a tracked stage in-process (or called
    # mlflow.set_tracking_uri) left MLflow's process-wide URI set, which wins over the variable:
    # a later `MlflowClient()` would read that test's store (seen: test_supervise after
    # test_tracking in one worker). Point it at this test's store too (MLflow already imported:
    # no import cost for tests that never touch it).
    if "mlflow" in sys.modules:
        sys.modules["mlflow"].set_tracking_uri(uri)
    before = mlflow_footprint(REPO)
    yield
    after = mlflow_footprint(REPO)
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    assert not changed, f"this test wrote MLflow data into the checkout: {changed}"
