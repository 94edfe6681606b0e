"""A pytest plugin: CPU seconds of each test file, its own process's and its children's.

Wall time (`--durations`) says which tests are long, not which ones cost the machine: a test
that waits on a daemon or a poll is long and cheap, one that starts a dozen Python processes is
short on a busy machine and expensive. This adds, per test file, the CPU time of the worker
(user + system, `RUSAGE_SELF`) and of the processes it started and waited for
(`RUSAGE_CHILDREN`: a subprocess, and whatever that one waited for in turn), measured around
each test's setup, call and teardown. Daemons a test leaves running are not counted.

    PYTHONPATH=tools .venv/bin/python -m pytest -p pytest_cputime --cpu-report OUT.json ...

With xdist each worker writes OUT.json.<worker id>; `python tools/pytest_cputime.py OUT.json*`
merges them and prints the files by CPU seconds (docs/measured.md).
"""

from __future__ import annotations

import json
import os
import resource
import sys
from collections import defaultdict

import pytest


def _cpu() -> tuple[float, float]:
    s = resource.getrusage(resource.RUSAGE_SELF)
    c = resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime, c.ru_utime + c.ru_stime


def pytest_addoption(parser):
    parser.addoption("--cpu-report", help="write CPU seconds per test file here (JSON)")


_TOTALS: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    own0, kids0 = _cpu()
    yield
    own1, kids1 = _cpu()
    t = _TOTALS[item.nodeid.split("::", 1)[0]]
    t[0] += own1 - own0
    t[1] += kids1 - kids0
    t[2] += 1


def pytest_sessionfinish(session):
    out = session.config.getoption("--cpu-report")
    if not out:
        return
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if not _TOTALS:  # the xdist controller runs no test
        return
    path = f"{out}.{worker}" if worker else out
    with open(path, "w") as fh:
        json.dump(
            {k: {"own_s": v[0], "children_s": v[1], "tests": v[2]} for k, v in _TOTALS.items()},
            fh,
            indent=1,
        )


def main(paths: list[str]) -> None:
    merged: dict[str, dict[str, float]] = {}
    for p in paths:
        for k, v in json.load(open(p)).items():
            merged[k] = v
    rows = sorted(merged.items(), key=lambda kv: -(kv[1]["own_s"] + kv[1]["children_s"]))
    total = sum(v["own_s"] + v["children_s"] for _, v in rows)
    print(f"{total:.0f} CPU-s in {len(rows)} files")
    print("| file | tests | CPU s (own + children) | own | children |")
    print("|---|---|---|---|---|")
    for k, v in rows[:40]:
        cpu = v["own_s"] + v["children_s"]
        print(f"| {k} | {v['tests']} | {cpu:.1f} | {v['own_s']:.1f} | {v['children_s']:.1f} |")


if __name__ == "__main__":
    main(sys.argv[1:])
