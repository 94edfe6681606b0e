"""A job run by the preforked server is the job its own process would have run.

Same outputs byte for byte (a real training stage both ways), same exit status and messages
on bad input, signals passed on, a killed job's child gone, and a server of another package
refused (the job then runs in its own process).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import snakemake_runner  # tests/ is on sys.path
import yaml
from proc_helpers import children as _children
from tiny_config import TINY_RAW

from dpadapter.launch import prefork

REPO = Path(__file__).resolve().parents[2]

SRC = Path(__file__).resolve().parents[2] / "src"


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != prefork.ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), env.get("PYTHONPATH", "")])
    env["DPADAPTER_THREADS"] = "1"
    env.update(prefork.thread_env(1))  # as Snakemake sets them for threads: 1
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One server for the module, its parent this test process; yields (socket path, its log)."""
    log = tmp_path_factory.mktemp("prefork") / "prefork.log"
    path = prefork.start(sys.executable, log, idle_seconds=120)
    _wait_until_serving(path, log)
    yield path, log
    prefork.stop(path)


def _wait_until_serving(path: str, log: Path, server: subprocess.Popen | None = None) -> None:
    """The socket appears once the server's imports are done (up to two minutes on a busy
    machine); a server that died first fails the test with its log."""
    deadline = time.monotonic() + 120
    while not os.path.exists(path):
        alive = server is None or server.poll() is None
        assert time.monotonic() < deadline and alive, log.read_text()
        time.sleep(0.1)


def _job(args: list[str], cwd: Path, socket_path: str | None, **popen) -> subprocess.Popen:
    env = _env(**({prefork.ENV: socket_path} if socket_path else {prefork.ENV: "0"}))
    return subprocess.Popen(
        [sys.executable, "-m", "dpadapter", *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **popen,
    )


def _config(tmp_path: Path) -> Path:
    raw = {**TINY_RAW, "tracking": {"enabled": False}}
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _forked_child(log: Path, out: Path, job: subprocess.Popen) -> int:
    """The pid of the server's child running the warm-up job writing to `out` (from the log)."""
    deadline = time.monotonic() + 60
    while f"warmup --out {out}" not in log.read_text():
        assert time.monotonic() < deadline and job.poll() is None
        time.sleep(0.05)
    line = [x for x in log.read_text().splitlines() if f"--out {out}" in x][-1]
    return int(line.split("pid ")[1].split(":")[0])


@contextlib.contextmanager
def _light_server(folder: Path, threads: int = 1, prelude: str = ""):
    """A server that preloads only the command line, for what does not depend on the imports
    (the guard at each fork, the routing by thread count); the full preload (about 6 s of CPU a
    server) is the module server's. Yields its socket path and log once it serves."""
    path = str(folder / ("jobs.sock" if threads == 1 else f"jobs-t{threads}.sock"))
    code = (
        f"{prelude}\nfrom dpadapter.launch import prefork\n"
        "prefork.PRELOAD, prefork.OPTIONAL_PRELOAD = ('dpadapter.launch.cli',), ()\n"
        f"prefork.serve({path!r}, {os.getpid()}, 60)"
    )
    log_path = folder / "server.log"
    env = _env(**prefork.thread_env(threads))
    with open(log_path, "wb") as log:
        srv = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=log, stderr=log)
    try:
        _wait_until_serving(path, log_path, srv)
        yield path, log_path
    finally:
        prefork.stop(path)
        srv.kill()
        srv.wait()


@pytest.mark.process
def test_a_training_stage_gives_the_same_files_both_ways(server, tmp_path):
    """Fine-tuning (DP-SGD, Poisson sampling, calibration) from a warm-up checkpoint, once in
    its own process and once forked: the same checkpoint and metrics, byte for byte."""
    path, log = server
    cfg = _config(tmp_path)
    warm = tmp_path / "warm"
    p = _job(["--config", str(cfg), "warmup", "--out", str(warm)], tmp_path, None)
    assert p.wait(timeout=300) == 0, p.stderr.read()
    outs = {}
    for way, sock in (("own", None), ("forked", path)):
        out = tmp_path / way
        args = ["--upstream", "scratch", "--task", "syn-same", "--algo", "dpsgd", "--eps", "1"]
        args += ["--seed", "0", "--ckpt", str(warm / "model.pt"), "--out", str(out)]
        p = _job(["--config", str(cfg), "finetune", *args], tmp_path, sock)
        stdout, stderr = p.communicate(timeout=300)
        assert p.returncode == 0, stderr
        outs[way] = out
    assert f"--out {outs['forked']}" in log.read_text()  # the server ran the second one
    own = sorted(p.relative_to(outs["own"]) for p in outs["own"].rglob("*") if p.is_file())
    forked = sorted(p.relative_to(outs["forked"]) for p in outs["forked"].rglob("*") if p.is_file())
    assert own == forked and own
    for rel in own:
        a, b = (outs[w] / rel for w in ("own", "forked"))
        if rel.suffix == ".json":
            # times differ; the second run recalls the first one's self-test (same results
            # folder: per_sample.check_memo), which its record says
            drop = {"wall_time_s", "host", "resources", "timing_s"}
            ja, jb = (
                {k: v for k, v in json.loads(x.read_text()).items() if k not in drop}
                for x in (a, b)
            )
            checks = [j.pop("per_sample_check", None) or {} for j in (ja, jb)]
            assert [c.pop("recalled", None) for c in checks] in ([False, True], [None, None])
            assert ja == jb and checks[0] == checks[1], rel
        else:
            assert a.read_bytes() == b.read_bytes(), rel
    # the training process's own resources, not the waiting client's (~17 MB, ~0 s CPU): what
    # Snakemake's benchmark files see of a forked job (docs/cluster.md sizes mem_mb from these)
    for way in ("own", "forked"):
        res = json.loads((outs[way] / "metrics.json").read_text())["resources"]
        assert res["max_rss_mib"] > 150 and res["cpu_user_s"] > 0.1, (way, res)


@pytest.mark.process
def test_bad_input_fails_the_same_way_both_ways(server, tmp_path):
    path, _ = server
    results = []
    for sock in (None, path):
        p = _job(["--config", str(tmp_path / "missing.yaml"), "validate"], tmp_path, sock)
        stdout, stderr = p.communicate(timeout=120)
        results.append((p.returncode, stdout, stderr))
    assert results[0] == results[1]
    assert results[0][0] != 0 and "missing.yaml" in results[0][2]


@pytest.mark.process
def test_a_signal_reaches_the_job_and_a_killed_job_leaves_no_child(server, tmp_path):
    path, log = server
    cfg = _config(tmp_path)
    server_pid = None
    for how in (signal.SIGTERM, signal.SIGKILL):
        out = tmp_path / f"out-{how}"
        p = _job(["--config", str(cfg), "warmup", "--out", str(out)], tmp_path, path)
        child = _forked_child(log, out, p)
        server_pid = server_pid or int(Path(f"/proc/{child}/stat").read_text().split()[3])
        p.send_signal(how)
        p.communicate(timeout=60)
        if how == signal.SIGTERM:
            assert p.returncode == 128 + signal.SIGTERM  # the child died of it, as the job would
        deadline = time.monotonic() + 10
        while child in _children(server_pid):
            assert time.monotonic() < deadline, f"child {child} outlived its job ({how!r})"
            time.sleep(0.05)
        assert not (out / "metrics.json").exists()


@pytest.mark.process
def test_a_server_of_another_package_is_refused(server, tmp_path, monkeypatch):
    path, log = server
    monkeypatch.setenv(prefork.ENV, path)
    monkeypatch.setattr(
        prefork, "_identity", lambda: {"executable": sys.executable, "package": "/elsewhere"}
    )
    monkeypatch.setattr(os, "environ", {**_env(), prefork.ENV: path})
    assert prefork.delegate(["--config", "other-package.yaml", "validate"]) is None
    assert "other-package.yaml" not in log.read_text()


@pytest.mark.process
def test_a_job_with_other_thread_settings_runs_in_its_own_process(server, tmp_path):
    """Native thread pools are sized when their library loads: the server's cannot be resized,
    and a different size can change float results, so such a job is not forked."""
    path, log = server
    cfg = _config(tmp_path)
    env = _env(**{prefork.ENV: path, "OMP_NUM_THREADS": "2"})
    p = subprocess.run(
        [sys.executable, "-m", "dpadapter", "--config", str(cfg), "validate"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    assert f"--config {cfg} validate" not in log.read_text()


@pytest.mark.process
def test_a_job_goes_to_the_server_of_its_thread_count(server, tmp_path, tmp_path_factory):
    """Warm-up and pre-training (workflow.cores threads) get a server of their own beside the
    one-thread server of the fine-tuning jobs: each job finds its own count's in the list."""
    one, one_log = server
    with _light_server(tmp_path_factory.mktemp("prefork2"), threads=2) as (two, log2):
        both = os.pathsep.join([one, two])
        for threads in ("2", "1"):
            cfg = _config(tmp_path).rename(tmp_path / f"threads{threads}.yaml")
            p = subprocess.run(
                [sys.executable, "-m", "dpadapter", "--config", str(cfg), "validate"],
                cwd=tmp_path,
                env=_env(**{prefork.ENV: both}, **prefork.thread_env(threads)),
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert p.returncode == 0 and "refused" not in p.stderr, p.stderr
        assert "threads2.yaml validate" in log2.read_text()
        assert "threads2.yaml validate" not in one_log.read_text()
        assert "threads1.yaml validate" in one_log.read_text()
        assert "threads1.yaml validate" not in log2.read_text()


def test_the_socket_list_is_read_by_thread_count(monkeypatch):
    both = os.pathsep.join(["/t/a/jobs.sock", "/t/b/jobs-t2.sock"])
    for threads, want in (("1", "/t/a/jobs.sock"), ("2", "/t/b/jobs-t2.sock"),
                          ("4", "/t/a/jobs.sock")):  # fmt: skip
        monkeypatch.setenv(prefork.THREAD_ENV[0], threads)
        assert prefork.server_for_this_job(both) == want
    assert prefork.server_for_this_job("/t/a/jobs.sock") == "/t/a/jobs.sock"
    assert prefork.server_for_this_job("") == ""


@pytest.mark.process
def test_a_run_uses_the_servers_it_inherits_only_when_they_serve_every_thread_count(tmp_path):
    """`prefork.inherited`: a parent's servers (the test suite's) are used where each thread
    count the run needs has one that is up or still starting; else the run starts its own."""
    one, two = tmp_path / "a" / "jobs.sock", tmp_path / "b" / "jobs-t2.sock"
    for p in (one, two):
        p.parent.mkdir()
    both = os.pathsep.join([str(one), str(two)])
    assert prefork.inherited(both, [1]) is None  # neither is up nor starting
    one.touch()
    assert prefork.inherited(both, [1]) == both
    assert prefork.inherited(both, [1, 2]) is None  # no 2-thread server
    Path(str(two) + prefork.STARTING).write_text(str(os.getpid()))  # importing, alive
    assert prefork.inherited(both, [1, 2]) == both
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    Path(str(two) + prefork.STARTING).write_text(dead)  # its server died while importing
    assert prefork.inherited(both, [1, 2]) is None
    for off in (None, "", "0"):
        assert prefork.inherited(off, [1]) is None


@pytest.mark.process
def test_a_workflow_run_uses_inherited_servers_and_stops_only_its_own(
    shared_fork_servers, tmp_path
):
    """A run started with the suite's servers in `DPADAPTER_PREFORK` forks its jobs from them,
    starts none of its own, and leaves them serving when it ends."""
    raw = json.loads(json.dumps(TINY_RAW))
    raw["tasks"] = {"syn-shift": raw["tasks"]["syn-shift"]}
    raw["pretrain"]["methods"] = ["scratch"]
    raw["finetune"]["epsilons"] = [4]
    raw["finetune"]["epochs"] = 1
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(raw))
    cmd = [sys.executable, "-m", "snakemake", "--snakefile", str(REPO / "Snakefile"),
           "--directory", str(tmp_path), "--cores", "2",
           "results/finetune/scratch/syn-shift/dpsgd/eps4/seed0/metrics.json"]  # fmt: skip
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlruns.db'}"}
    r = snakemake_runner.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert not (tmp_path / "results" / "logs" / "prefork.log").exists()  # no server of its own
    for path in shared_fork_servers.env.split(os.pathsep):
        assert os.path.exists(path), path  # still serving
    served = shared_fork_servers.log.read_text()
    assert "finetune --upstream scratch --task syn-shift" in served, served[-2000:]
    assert "pretrain --method scratch" in served, served[-2000:]


def test_no_server_or_switched_off_runs_in_process(tmp_path, monkeypatch):
    monkeypatch.setenv(prefork.ENV, str(tmp_path / "no.sock"))
    assert prefork.delegate(["validate"]) is None
    monkeypatch.setenv(prefork.ENV, "0")
    assert prefork.delegate(["validate"]) is None
    monkeypatch.setenv(prefork.ENV, str(tmp_path / "no.sock"))
    monkeypatch.setenv("SLURM_JOB_ID", "1")
    assert prefork.delegate(["validate"]) is None


_HAZARDS = {
    # a preloaded module (or a future edit) that initialised CUDA in the server
    "cuda": "import torch; torch.cuda.is_initialized = lambda: True",
    # a second Python thread alive in the server at fork time
    "thread": "import threading, time; threading.Thread("
    "target=time.sleep, args=(600,), name='stray-worker', daemon=True).start()",
}


@pytest.mark.process
@pytest.mark.parametrize("hazard", sorted(_HAZARDS))
def test_a_server_that_cannot_fork_safely_refuses_by_name(hazard, tmp_path):
    """The server checks before every fork that CUDA is not initialised in it and that it runs
    one Python thread; otherwise the job runs in its own process and is told why.

    The server preloads only the command line (`_light_server`): the guard is checked at every
    fork whatever was imported."""
    with _light_server(tmp_path, prelude=_HAZARDS[hazard]) as (path, log):
        cfg = _config(tmp_path)
        p = _job(["--config", str(cfg), "validate"], tmp_path, path)
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        want = "CUDA is initialised" if hazard == "cuda" else "stray-worker"
        assert "the fork server refused this job" in err and want in err, err
        served = log.read_text()
        assert (
            "refused: " in served and f"--config {cfg} validate" not in served.split("refused")[0]
        )
        assert " pid " not in served  # no child was forked


@pytest.mark.process
def test_the_preloaded_imports_leave_the_server_safe_to_fork(server):
    """What the server imports (torch, Opacus, MLflow, timm) starts no Python thread and no
    CUDA context: its first log line says so, and the guard above never refused its jobs. And
    what it imported is frozen out of the collector's reach: each child's first full collection
    walked it all (~0.35 s of a tiny job)."""
    _, log = server
    text = log.read_text()
    assert "(1 Python thread), CUDA initialised: False" in text.splitlines()[0], text[:500]
    frozen = int(re.search(r"(\d+) objects frozen", text.splitlines()[0]).group(1))
    assert frozen > 100_000, text[:500]  # torch alone makes more
    assert "refused: " not in text


@pytest.mark.process
def test_a_child_killed_for_memory_says_so(server, tmp_path):
    """The kernel's OOM killer sends SIGKILL to the training process (the forked child): the
    job's own process reports why and what to change, with the job's settings, and exits 137."""
    path, log = server
    cfg = tmp_path / "tiny.json"
    raw = {**TINY_RAW, "tracking": {"enabled": False}}
    raw["finetune"] = {**raw["finetune"], "grad_sample_mode": "hooks", "physical_batch_size": 25}
    # minutes of warm-up: the job is surely still running when it is killed (a loaded machine)
    raw["warmup"] = {**raw["warmup"], "epochs": 500}
    cfg.write_text(json.dumps(raw))
    out = tmp_path / "out"
    p = _job(["--config", str(cfg), "warmup", "--out", str(out)], tmp_path, path)
    child = _forked_child(log, out, p)
    # the server logs the pid right after the fork; a child killed before it told the client it
    # took the job (a few ms later) makes the client run the job itself: kill it once it trains
    time.sleep(2.0)
    assert p.poll() is None
    os.kill(child, signal.SIGKILL)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 128 + signal.SIGKILL, err[-2000:]
    assert "warmup was killed by SIGKILL" in err and "out-of-memory" in err, err
    assert "grad_sample_mode: hooks" in err and "physical_batch_size: 25" in err


def _forked_draws(tmp_path: Path, name: str, monkeypatch, seed: int | None = None) -> list:
    """What a job's global `random` and numpy draw first, run by the server's child code in a
    process forked from this one (as the server forks: the parent's state, inherited)."""
    import random
    import socket

    import numpy as np

    out = tmp_path / name

    def job(argv: list[str]) -> int:
        if seed is not None:
            random.seed(seed)
            np.random.seed(seed)
        out.write_text(json.dumps([random.random(), float(np.random.random())]))
        return 0

    monkeypatch.setattr(prefork, "_run", job)
    parent, child = socket.socketpair()
    pid = os.fork()
    if pid == 0:  # the child: never returns (prefork._child ends with os._exit)
        parent.close()
        fds = [os.open(os.devnull, os.O_RDWR) for _ in range(3)]
        prefork._child(child, fds, {"cwd": str(tmp_path), "env": dict(os.environ), "argv": []})
    child.close()
    os.waitpid(pid, 0)
    parent.close()
    return json.loads(out.read_text())


@pytest.mark.process
def test_forked_jobs_do_not_share_the_global_random_streams(tmp_path, monkeypatch):
    """Two jobs forked from one server state draw different numbers from `random` and numpy's
    global generator, unless the job seeds them itself."""
    import random

    import numpy as np

    random.seed(1)
    np.random.seed(1)  # the server's state, which every child inherits
    a = _forked_draws(tmp_path, "a.json", monkeypatch)
    b = _forked_draws(tmp_path, "b.json", monkeypatch)
    assert a[0] != b[0], "random's global state is shared by forked jobs"
    assert a[1] != b[1], "numpy's global state is shared by forked jobs"
    seeded = [_forked_draws(tmp_path, f"s{i}.json", monkeypatch, seed=7) for i in range(2)]
    assert seeded[0] == seeded[1]


@pytest.mark.process
def test_a_forked_job_has_its_own_processs_state_not_the_servers(tmp_path, monkeypatch):
    """A job forked from the server sees what its own process would: the client's environment
    and sys.path (sent with the job), and torch's generator seeded afresh (a fresh process seeds
    it from the OS), whatever the server (here: this process) set or drew before the fork."""
    import socket

    import torch

    torch.manual_seed(3)  # the server's state, which every child inherits
    monkeypatch.setenv("SERVER_ONLY", "1")
    monkeypatch.setattr(sys, "path", ["/server/only", *sys.path])
    env = {k: v for k, v in os.environ.items() if k != "SERVER_ONLY"} | {"CLIENT_ONLY": "1"}
    path = [*sys.path[1:], "/client/only"]

    def run_job(name: str) -> list:
        out = tmp_path / name

        def job(argv: list[str]) -> int:
            out.write_text(json.dumps([torch.rand(1).item(), dict(os.environ), sys.path]))
            return 0

        monkeypatch.setattr(prefork, "_run", job)
        parent, child = socket.socketpair()
        pid = os.fork()
        if pid == 0:
            parent.close()
            fds = [os.open(os.devnull, os.O_RDWR) for _ in range(3)]
            message = {"cwd": str(tmp_path), "env": env, "path": path, "argv": []}
            prefork._child(child, fds, message)
        child.close()
        os.waitpid(pid, 0)
        parent.close()
        return json.loads(out.read_text())

    a, b = run_job("a.json"), run_job("b.json")
    server_next = torch.rand(1).item()
    assert a[0] != b[0] and server_next not in (a[0], b[0]), "torch's state is the server's"
    assert a[1] == env and "SERVER_ONLY" not in a[1]
    assert a[2] == path and "/server/only" not in a[2]
