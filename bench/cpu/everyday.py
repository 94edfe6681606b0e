"""The README's two commands, old code beside new on one machine: `make run` and `make test`.

Machines of one kind differ by up to 2x in speed, so a figure of the everyday loop means
something only beside the old code's, measured on the same machine one after the other. This
clones the repository twice (the two revisions), and in each fresh clone times `make run`
(set-up included, as a new user runs it), then `make test` in another fresh clone, and prints
one table: wall seconds of each, and per rule of the run the split `bench/cpu/overhead.py` gives
(the fine-tuning jobs' phases too, where the code records them). Run it on a quiet machine:

    .venv/bin/python bench/cpu/everyday.py OLD_REV NEW_REV [--only run|test] [--json OUT]

About 45 minutes on the 2-core machine for both commands of both revisions. The figures go to
docs/measured.md with the date, the two commits and the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _clone(rev: str, into: Path) -> Path:
    subprocess.run(["git", "clone", "-q", str(ROOT), str(into)], check=True)
    subprocess.run(["git", "-C", str(into), "checkout", "-q", rev], check=True)
    return into


def _timed(cmd: list[str], cwd: Path, log: Path) -> tuple[float, int]:
    t0 = time.perf_counter()
    with open(log, "w") as fh:
        rc = subprocess.run(cmd, cwd=cwd, stdout=fh, stderr=subprocess.STDOUT).returncode
    return time.perf_counter() - t0, rc


def measure(rev: str, what: list[str], work: Path) -> dict:
    out: dict = {"rev": rev}
    env_note = "fresh clone, set-up included"
    if "run" in what:
        clone = _clone(rev, work / f"run-{rev}")
        wall, rc = _timed(["make", "run"], clone, work / f"run-{rev}.log")
        split = subprocess.run(
            [sys.executable, str(ROOT / "bench" / "cpu" / "overhead.py"), "results"],
            cwd=clone,
            capture_output=True,
            text=True,
        )
        out["run"] = {"wall_s": round(wall, 1), "rc": rc, "how": env_note, "split": split.stdout}
    if "test" in what:
        clone = _clone(rev, work / f"test-{rev}")
        wall, rc = _timed(["make", "test"], clone, work / f"test-{rev}.log")
        tail = (work / f"test-{rev}.log").read_text().strip().splitlines()[-1:]
        out["test"] = {"wall_s": round(wall, 1), "rc": rc, "how": env_note, "summary": tail}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--only", choices=["run", "test"])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--work", type=Path, help="keep the clones here (default: a temp folder)")
    args = ap.parse_args(argv)
    what = [args.only] if args.only else ["run", "test"]
    with tempfile.TemporaryDirectory(prefix="everyday-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        results = [measure(rev, what, work) for rev in (args.old, args.new)]
    machine = f"{platform.node()}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f} at end"
    print(f"# old {args.old} beside new {args.new} ({machine}, {time.strftime('%Y-%m-%d')})\n")
    print("| command | old | new | new / old |")
    print("|---|---|---|---|")
    for cmd in what:
        o, n = results[0][cmd], results[1][cmd]
        flag = "" if o["rc"] == n["rc"] == 0 else f" (exit {o['rc']} / {n['rc']})"
        ratio = n["wall_s"] / o["wall_s"] if o["wall_s"] else float("nan")
        print(f"| make {cmd} | {o['wall_s']} s | {n['wall_s']} s | {ratio:.2f}{flag} |")
    for r in results:
        if "run" in r:
            print(f"\n## make run of {r['rev']}: where the time went\n\n{r['run']['split']}")
        if "test" in r:
            print(f"make test of {r['rev']}: {' '.join(r['test']['summary'])}")
    if args.json:
        args.json.write_text(json.dumps({"machine": machine, "results": results}, indent=1))
    return 0 if all(r[c]["rc"] == 0 for r in results for c in what) else 1


if __name__ == "__main__":
    sys.exit(main())
