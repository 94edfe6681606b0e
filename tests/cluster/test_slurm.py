"""The Slurm profile on a real Slurm: `snakemake --profile slurm` submits every job with sbatch.

A one-node cluster runs on localhost for the duration of this module: munged, slurmctld and
slurmd from Debian's `munge` and `slurm-wlm` (installed with apt when missing; needs root),
configured in /etc/slurm/slurm.conf (Slurm's nested `srun` inside each job finds no
configuration from SLURM_CONF alone), no slurmdbd (so `--slurm-status-command squeue`).
Every daemon is stopped by PID afterwards and the configuration files are removed again; the
test skips rather than replace a configuration it did not write.

The node is declared with 2 GPUs, >= 16 CPUs and >= 40 GB (`SlurmdParameters=config_overrides`:
only the scheduler's bookkeeping, nothing is enforced with proctrack/linuxproc and task/none),
so the jobs request exactly what the profile asks for on a real GPU cluster: `--gpus=1` for
training, a CPU partition for aggregation, the per-rule time limits and memory. The "GPUs" are
/dev/null and /dev/zero: Slurm only hands their indices out (CUDA_VISIBLE_DEVICES). Two of them
let a fine-tuning job of `finetune.processes: 2` ask for `--gpus=2` on the one node, as it
would on a GPU cluster; its config says `device: cpu`, so its two processes train on gloo.
"""

from __future__ import annotations

import contextlib
import csv
import getpass
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from cluster_helpers import (
    REPO,
    VENV_BIN,
    file_lock,
    job_env,
    port_in_use,
    require_debian_packages,
    start_daemon,
    stop_daemon,
    tiny_workdir,
    wait_until,
)

pytestmark = pytest.mark.slow

MARKER = "# written by dpadapter tests/cluster/test_slurm.py"
CONF_FILES = [Path("/etc/slurm/slurm.conf"), Path("/etc/slurm/gres.conf")]
SLURM_BINARIES = ["slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "srun", "scancel"]
PROFILE = yaml.safe_load((REPO / "slurm" / "config.yaml").read_text())
STEADY_POLL = Path(__file__).with_name("steady_poll_snakemake.py")  # `snakemake`, steady polls


# Slurm clients read SLURM_CONF (and other SLURM_* defaults) before /etc/slurm/slurm.conf.
CLIENT_ENV = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_"))}


def _run(cmd: list[str], timeout: float = 30, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, env=CLIENT_ENV, **kw
    )


def _slurm_conf(host: str, state: Path, ctld_port: int, slurmd_port: int) -> str:
    cpus = max(os.cpu_count() or 1, 16)
    mem_mb = max(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20, 40000)
    return f"""{MARKER}
ClusterName=dpadapter-test
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=1000
SchedulerType=sched/builtin
# jobs stay visible to squeue this long after they end (the executor's status source)
MinJobAge=600
ReturnToService=2
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
StateSaveLocation={state}/ctld
SlurmdSpoolDir={state}/spool
SlurmctldPidFile={state}/slurmctld.pid
SlurmdPidFile={state}/slurmd.pid
SlurmctldLogFile={state}/slurmctld.log
SlurmdLogFile={state}/slurmd.log
GresTypes=gpu
SlurmdParameters=config_overrides
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={mem_mb} Gres=gpu:2 State=UNKNOWN
"""


def _partition_lines(host: str) -> str:
    """Every partition the profile names (the GPU and the CPU one), all on the one node."""
    names = {_value(PROFILE["default-resources"]["slurm_partition"])}
    names |= {
        _value(r["slurm_partition"])
        for r in PROFILE["set-resources"].values()
        if "slurm_partition" in r
    }
    return "".join(
        f"PartitionName={n} Nodes={host} MaxTime=INFINITE State=UP\n" for n in sorted(names)
    )


def _munge_works() -> bool:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        enc = _run(["munge", "-n"], timeout=10)
        if enc.returncode == 0:
            return _run(["unmunge"], input=enc.stdout, timeout=10).returncode == 0
    return False


@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory):
    """A running one-node Slurm cluster on localhost; yields the state directory."""
    if not sys.platform.startswith("linux"):
        pytest.skip("Slurm daemons run on Linux only")
    if os.geteuid() != 0:
        pytest.skip("starting munged, slurmctld and slurmd needs root")
    require_debian_packages(["slurm-wlm", "munge"], [*SLURM_BINARIES, "munged", "munge"])
    with file_lock(Path("/tmp/dpadapter-tests-slurm.lock"), timeout_s=1800) as locked:
        if not locked:
            pytest.skip("another test process has been running the test cluster for 30 min")
        foreign = [p for p in CONF_FILES if p.exists() and MARKER not in p.read_text()]
        if foreign:
            pytest.skip(f"{foreign[0]} belongs to a real Slurm installation; not replacing it")
        yield from _cluster(tmp_path_factory.mktemp("slurm"))


def _cluster(state: Path):
    host = socket.gethostname().split(".")[0]
    ports = [p for p in range(16817, 16900) if not port_in_use(p)][:2]
    (state / "ctld").mkdir()
    (state / "spool").mkdir()
    started: list[subprocess.Popen] = []
    try:
        # munge: socket folder world-executable, else slurmd's job steps cannot authenticate.
        run_munge = Path("/run/munge")
        run_munge.mkdir(mode=0o755, parents=True, exist_ok=True)
        shutil.chown(run_munge, "munge", "munge")
        run_munge.chmod(0o755)
        if not _munge_works():
            if not Path("/etc/munge/munge.key").exists():
                subprocess.run(["mungekey", "--create"], check=True, user="munge")
            munged = start_daemon(
                ["munged", "--foreground"], state / "munged.out", user="munge", group="munge"
            )
            started.append(munged)
            wait_until(_munge_works, 30, "munged", log=state / "munged.out")
        Path("/etc/slurm").mkdir(exist_ok=True)
        CONF_FILES[0].write_text(_slurm_conf(host, state, *ports) + _partition_lines(host))
        CONF_FILES[1].write_text(
            f"{MARKER}\nAutoDetect=off\nName=gpu File=/dev/null\nName=gpu File=/dev/zero\n"
        )
        started.append(start_daemon(["slurmctld", "-D", "-i"], state / "slurmctld.out"))
        started.append(start_daemon(["slurmd", "-D", "-N", host], state / "slurmd.out"))

        def idle() -> bool:
            r = _run(["sinfo", "-h", "-N", "-o", "%t"], timeout=10)
            return r.returncode == 0 and set(r.stdout.split()) == {"idle"}

        wait_until(idle, 90, "the node to be idle", log=state / "slurmctld.log")
        yield state
    finally:
        with contextlib.suppress(Exception):
            _run(["scancel", "--user", getpass.getuser()], timeout=30)
            wait_until(lambda: _run(["squeue", "-h", "-t", "R,CG,PD"]).stdout == "", 60, "jobs")
        for proc in reversed(started):
            stop_daemon(proc)
        for p in CONF_FILES:  # only ours: the fixture skips when a file it did not write exists
            if p.exists() and MARKER in p.read_text():
                p.unlink()
        assert all(proc.poll() is not None for proc in started)


def _jobs() -> list[dict[str, str]]:
    """Every job the test cluster has seen (`scontrol show job -o`: one line of KEY=VALUE each)."""
    out = _run(["scontrol", "show", "job", "-o"]).stdout
    return [
        dict(tok.split("=", 1) for tok in line.split() if "=" in tok)
        for line in out.splitlines()
        if line.startswith("JobId=")
    ]


def _value(expr) -> object:
    """A profile resource value: a Python expression, possibly of `attempt` (first attempt)."""
    return eval(str(expr), {"attempt": 1})


def _minutes(limit: str) -> int:
    days, _, hms = limit.rpartition("-")
    h, m, s = (int(x) for x in hms.split(":"))
    return (int(days) if days else 0) * 1440 + h * 60 + m + (s > 0)


def test_profile_runs_the_pipeline_through_sbatch(slurm_cluster, tiny_raw, tmp_path, _fork_servers):
    # The upstream method that needs the warm-up, one task, one epsilon: 4 jobs, every rule of
    # the summary table (the scratch pre-training goes through sbatch in the test below).
    raw = tiny_raw
    raw["pretrain"]["methods"] = ["standard"]
    raw["tasks"] = {"syn-shift": raw["tasks"]["syn-shift"]}
    raw["finetune"]["epsilons"] = [4]
    raw["finetune"]["epochs"] = 1
    wd = tiny_workdir(tmp_path / "wd", raw)
    # `snakemake --profile slurm` from a repository root (a stand-in holding the profile, so
    # nothing is written into the real one), working directory elsewhere.
    root = tmp_path / "root"
    root.mkdir()
    (root / "slurm").symlink_to(REPO / "slurm")
    cmd = [
        str(VENV_BIN / "python"), str(STEADY_POLL), "--profile", "slurm",
        "--snakefile", str(REPO / "Snakefile"), "--directory", str(wd),
        # What this test cluster needs beyond the profile: no slurmdbd, so squeue reports job
        # states; fast polling for short jobs (steady: STEADY_POLL turns off the plugin's
        # growing waits); logs kept for the checks below; fail fast.
        "--slurm-status-command", "squeue", "--slurm-init-seconds-before-status-checks", "1",
        "--seconds-between-status-checks", "1", "--slurm-keep-successful-logs",
        "--jobs", "2", "--retries", "0", "--latency-wait", "10",
        # the pipeline up to its summary table (not the figures drawn from it)
        "results/summary/finetune.csv", "results/summary/finetune.md",
    ]  # fmt: skip
    r = subprocess.run(cmd, cwd=root, env=job_env(wd), capture_output=True, text=True, timeout=1200)
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-6000:]

    # Every job went through sbatch, with the resources the profile sets for its rule.
    submitted = re.findall(r"has been submitted with SLURM jobid (\d+)", log)
    jobs = {j["JobId"]: j for j in _jobs()}
    assert sorted(submitted) == sorted(jobs), (submitted, sorted(jobs))
    assert all(j["JobState"] == "COMPLETED" for j in jobs.values()), jobs
    comments = {j["Comment"] for j in jobs.values()}
    assert comments == {
        "rule_warmup",
        "rule_pretrain_wildcards_standard",
        # the profile's group: the fine-tuning jobs of one upstream model, one allocation
        "rule_finetune-standard_finetune",
        "rule_aggregate",
    }
    defaults, per_rule = PROFILE["default-resources"], PROFILE["set-resources"]
    for job in jobs.values():
        rule = job["Comment"].removeprefix("rule_").split("_wildcards_")[0]
        rule = re.sub(r"^finetune-[^_]+_", "", rule)  # group `finetune-<upstream>_<its rules>`
        wants_gpu = "gpu" in job.get("TresPerJob", "")
        res = {**defaults, **per_rule.get(rule, {})}
        assert job["Partition"] == _value(res["slurm_partition"]), job
        assert job["Partition"] == ("gpu" if wants_gpu else "cpu"), job
        assert job["Account"] == _value(res["slurm_account"])
        if rule not in per_rule or "runtime" not in per_rule[rule]:
            continue  # a rule the profile does not size keeps its own resources
        gpus = res.get("gpu", 1 if rule in ("warmup", "pretrain", "finetune") else 0)  # processes
        assert wants_gpu == bool(gpus), job
        if wants_gpu:
            assert job["TresPerJob"] in (f"gres:gpu:{gpus}", f"gres/gpu:{gpus}"), job
            assert job["NumNodes"] == "1", job
        assert _minutes(job["TimeLimit"]) == _value(res["runtime"])
        assert job["MinMemoryNode"] == f"{_value(res['mem_mb'])}M"
        assert int(job["NumCPUs"]) == PROFILE["set-threads"][rule]
    slurm_logs = list((wd / ".snakemake" / "slurm_logs").rglob("*.log"))
    assert sorted(p.stem for p in slurm_logs) == sorted(jobs)

    # The results are those of the pipeline: the summary table, one MLflow run per job ...
    rows = list(csv.DictReader(open(wd / "results" / "summary" / "finetune.csv")))
    assert {(row["upstream"], row["task"], row["epsilon"]) for row in rows} == {
        ("standard", "syn-shift", "4"),
    }
    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{wd / 'mlruns.db'}")
    runs = mlflow.search_runs(experiment_names=[raw["tracking"]["experiment"]])
    jobs = runs["tags.stage"].dropna()  # not the stages' group runs
    assert sorted(jobs) == ["finetune", "pretrain", "warmup"]
    assert set(runs["status"]) == {"FINISHED"}

    # ... and the same numbers a local run of a job computes from the same checkpoint.
    job_dir = Path("results/finetune/standard/syn-shift/dpsgd/eps4/seed0")
    on_slurm = json.loads((wd / job_dir / "metrics.json").read_text())
    assert on_slurm["privacy"]["epsilon"] <= 4
    ft_log = next(p for p in slurm_logs if "group_finetune-standard" in str(p))
    threads = re.search(r"DPADAPTER_THREADS=(\d+) \S+ -m dpadapter", ft_log.read_text()).group(1)
    config = re.search(r"--config (\S+) finetune", ft_log.read_text()).group(1)
    # the local reference job (never a Slurm job) forked from the tests' server of its thread
    # count where it is up (`ForkServers.job_env`): the same files as its own process
    local = subprocess.run(
        [
            sys.executable, "-m", "dpadapter", "--config", config, "finetune",
            "--upstream", "standard", "--task", "syn-shift", "--algo", "dpsgd", "--eps", "4",
            "--seed", "0", "--ckpt", "results/pretrain/standard/model.pt", "--out", "local",
        ],
        cwd=wd, env=job_env(wd, MLFLOW_TRACKING_URI="sqlite:///local.db",
                            **_fork_servers.job_env(threads)),
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert local.returncode == 0, local.stderr[-3000:]
    here = json.loads((wd / "local" / "metrics.json").read_text())
    assert here["privacy"] == on_slurm["privacy"]
    assert here["test_accuracy"] == on_slurm["test_accuracy"]
    w_here = torch.load(wd / "local" / "model.pt", weights_only=False)["state_dict"]
    w_slurm = torch.load(wd / job_dir / "model.pt", weights_only=False)["state_dict"]
    assert all(torch.allclose(w_here[k], w_slurm[k], atol=1e-6) for k in w_slurm)


def test_one_job_in_two_processes_through_the_profile(
    slurm_cluster, tiny_raw, tmp_path, _fork_servers
):
    """`finetune.processes: 2` through the unchanged profile: the fine-tuning job's allocation
    (a group of one) asks for 2 GPUs on one node, which the test node's two stand-in GPUs give;
    with `device: cpu` the two processes train on gloo. One metrics.json, written by rank 0,
    with the epsilon of the same job in one process."""
    raw = tiny_raw
    raw["device"] = "cpu"  # the node's "GPUs" are /dev/null and /dev/zero
    raw["tasks"] = {"syn-shift": raw["tasks"]["syn-shift"]}
    raw["pretrain"]["methods"] = ["scratch"]  # no warm-up: pre-training, then one fine-tuning
    raw["finetune"]["epsilons"] = [4]
    raw["finetune"]["epochs"] = 1
    raw["finetune"]["processes"] = 2
    wd = tiny_workdir(tmp_path / "wd", raw)
    root = tmp_path / "root"
    root.mkdir()
    (root / "slurm").symlink_to(REPO / "slurm")
    job_dir = Path("results/finetune/scratch/syn-shift/dpsgd/eps4/seed0")
    cmd = [
        str(VENV_BIN / "python"), str(STEADY_POLL), "--profile", "slurm",
        "--snakefile", str(REPO / "Snakefile"), "--directory", str(wd),
        "--slurm-status-command", "squeue", "--slurm-init-seconds-before-status-checks", "1",
        "--seconds-between-status-checks", "1", "--slurm-keep-successful-logs",
        "--jobs", "2", "--retries", "0", "--latency-wait", "10",
        str(job_dir / "metrics.json"),
    ]  # fmt: skip
    # torchrun's own per-rank logs (its `--log-dir`, through the variable that carries the
    # rendezvous options of several nodes: the job's environment reaches it under Slurm).
    ranks = wd / "torchrun"
    env = job_env(wd, DPADAPTER_TORCHRUN_ARGS=f"--standalone --log-dir {ranks} --tee 3")
    r = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=900)
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-6000:]

    # Two sbatch jobs of this run (the cluster also lists the earlier test's): the pre-training
    # on one GPU, the fine-tuning group on two GPUs of one node.
    submitted = re.findall(r"has been submitted with SLURM jobid (\d+)", log)
    jobs = {j["Comment"]: j for j in _jobs() if j["JobId"] in submitted}
    assert sorted(jobs) == ["rule_finetune-scratch_finetune", "rule_pretrain_wildcards_scratch"]
    assert all(j["JobState"] == "COMPLETED" for j in jobs.values()), jobs
    ft, pre = jobs["rule_finetune-scratch_finetune"], jobs["rule_pretrain_wildcards_scratch"]
    assert ft["TresPerJob"] in ("gres:gpu:2", "gres/gpu:2"), ft
    assert ft["NumNodes"] == "1" and ft["Partition"] == "gpu", ft
    assert pre["TresPerJob"] in ("gres:gpu:1", "gres/gpu:1"), pre

    # Two processes, one attempt (torchrun writes a folder per local rank); one metrics.json,
    # rank 0's: rank 1 reports nothing.
    attempts = sorted(p.relative_to(ranks).parts[1:] for p in ranks.glob("*/attempt_*/*"))
    assert attempts == [("attempt_0", "0"), ("attempt_0", "1")], attempts
    rank1 = next(ranks.glob("*/attempt_0/1/stdout.log")).read_text()
    assert "test accuracy" not in rank1 and "test accuracy" in log_of(wd, job_dir)
    written = sorted((wd / "results" / "finetune").rglob("metrics.json"))
    assert written == [wd / job_dir / "metrics.json"], written
    two = json.loads((wd / job_dir / "metrics.json").read_text())

    # The same job in one process, with the CLI and the same checkpoint: the same epsilon.
    merged = json.loads(next((wd / "results" / ".config").glob("*.json")).read_text())
    assert merged["finetune"]["processes"] == 2
    merged["finetune"]["processes"] = 1
    (wd / "one.json").write_text(json.dumps(merged))
    local = subprocess.run(
        [
            sys.executable, "-m", "dpadapter", "--config", "one.json", "finetune",
            "--upstream", "scratch", "--task", "syn-shift", "--algo", "dpsgd", "--eps", "4",
            "--seed", "0", "--ckpt", "results/pretrain/scratch/model.pt", "--out", "local",
        ],
        cwd=wd, env=job_env(wd, MLFLOW_TRACKING_URI="sqlite:///local.db",
                            **_fork_servers.job_env(1)),
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert local.returncode == 0, local.stderr[-3000:]
    one = json.loads((wd / "local" / "metrics.json").read_text())
    # The same releases (noise multiplier, q, steps) give the same epsilon; its last bits follow
    # the accountant's numerics (BLAS threads: torchrun sets OMP_NUM_THREADS=1).
    assert two["privacy"]["history"] == one["privacy"]["history"]
    assert two["privacy"]["epsilon"] == pytest.approx(one["privacy"]["epsilon"], rel=1e-12)
    assert two["privacy"]["epsilon"] <= 4
    # ... from other batches: rank 1 samples its shard with its own generator, so the weights
    # are not the one-process run's (they would be, had the job run in one process)
    w_two = torch.load(wd / job_dir / "model.pt", weights_only=False)["state_dict"]
    w_one = torch.load(wd / "local" / "model.pt", weights_only=False)["state_dict"]
    assert any(not torch.equal(w_two[k], w_one[k]) for k in w_one)


def log_of(wd: Path, job_dir: Path) -> str:
    """The job's own log (results/logs/finetune/...), beside its Slurm log."""
    rel = job_dir.relative_to("results/finetune")
    return (wd / "results" / "logs" / "finetune" / rel.parent / f"{rel.name}.log").read_text()
