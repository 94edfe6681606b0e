"""Slurm's client commands without a Slurm, for counting allocations (test_slurm_groups.py).

Called as `fake_slurm.py <client> ARGS` by one small script per client name (`sbatch`,
`sacct`, ...) in a folder put first on PATH; `$FAKE_SLURM_DIR` holds its state. `sbatch`
records every submission (its arguments and the jobs it carries) and stands in for the job:
it creates the outputs of the jobs named by the submission's `--target-jobs`, from
`outputs.json` (rule:wildcards -> files, read off a dry run), so Snakemake goes on to the
next level of the DAG. `sacct`/`squeue` report every job submitted so far as COMPLETED (and
note how many that was in `polls.jsonl`);
`sacctmgr`/`sshare` know the profile's account; the rest print nothing. No job's command runs.
"""

import fcntl
import json
import os
import re
import shlex
import sys
from pathlib import Path

STATE = Path(os.environ["FAKE_SLURM_DIR"])
SUBMISSIONS = STATE / "submissions.jsonl"


def job_key(spec: str) -> str:
    """`rule:k=v,k=v` with the wildcards sorted (Snakemake's --target-jobs spelling)."""
    rule, _, wildcards = spec.partition(":")
    return rule + ":" + ",".join(sorted(w for w in wildcards.split(",") if w))


def targets(command: str) -> list[str]:
    m = re.search(r"--target-jobs (.*?) --", command)
    return [job_key(s) for s in shlex.split(m.group(1))] if m else []


def sbatch(argv: list[str]) -> None:
    command = " ".join(argv) + " " + (sys.stdin.read() if not sys.stdin.isatty() else "")
    workdir = Path(argv[argv.index("-D") + 1]) if "-D" in argv else Path.cwd()
    outputs = json.loads((STATE / "outputs.json").read_text())
    jobs = targets(command)
    for key in jobs:
        for f in outputs[key]:
            path = workdir / f
            path.parent.mkdir(parents=True, exist_ok=True)
            path.touch()
    with open(STATE / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        n = sum(1 for _ in open(SUBMISSIONS)) if SUBMISSIONS.exists() else 0
        jobid = 1000 + n
        with open(SUBMISSIONS, "a") as fh:
            fh.write(json.dumps({"jobid": jobid, "argv": argv, "jobs": jobs}) + "\n")
    print(jobid)


def main() -> None:
    tool = sys.argv[1]
    if tool == "sbatch":
        sbatch(sys.argv[2:])
    elif tool in ("sacct", "squeue") and SUBMISSIONS.exists():
        lines = open(SUBMISSIONS).readlines()
        with open(STATE / "polls.jsonl", "a") as fh:  # what each status query saw
            fh.write(json.dumps({"submitted": len(lines)}) + "\n")
        for line in lines:
            print(f"{json.loads(line)['jobid']}|COMPLETED")
    elif tool in ("sacctmgr", "sshare"):
        print(os.environ.get("FAKE_SLURM_ACCOUNT", "dpadapter"))


if __name__ == "__main__":
    main()
