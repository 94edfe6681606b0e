"""bench/gpu/gpu_session.sh --dry-run: the one GPU command, every step at tiny size on the CPU.

The GPU is lent rarely and briefly; this keeps the command from rotting between loans (as
`gpu_paper_timing.py` once did). The dry run hides MLflow, as on the bare GPU image, makes one
step overrun its cap and one Table 2 cell overrun the deadline, and must still write at most 8
files, none in a subfolder, with a summary that reports both as cut and never as results.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
from bench_scripts import import_bench

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def dry(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-session-out")
    work = tmp_path_factory.mktemp("gpu-session-work")
    env = {**os.environ, "PYTHON": sys.executable}
    env.pop("MLFLOW_TRACKING_URI", None)
    # a cell an earlier loan finished: the call must skip it and start with the next ones
    done = tmp_path_factory.mktemp("gpu-runs-cells")
    (done / "dpsgd" / "eps3" / "seed0").mkdir(parents=True)
    (done / "dpsgd" / "eps3" / "seed0" / "metrics.json").write_text("{}")
    p = subprocess.run(
        ["bash", str(REPO / "bench/gpu/gpu_session.sh"), "--dry-run", str(out),
         "--work", str(work), "--done", str(done)],
        capture_output=True, text=True, env=env, timeout=400,
    )  # fmt: skip
    return p, out, work


@pytest.mark.process
def test_the_dry_run_writes_at_most_eight_flat_files(dry):
    p, out, _ = dry
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    files = sorted(out.iterdir())
    assert 1 <= len(files) <= 8 and all(f.is_file() for f in files), files
    names = {f.name for f in files}
    assert {"summary.md", "session.json", "logs.txt", "artifacts.tar.gz"} <= names
    with tarfile.open(out / "artifacts.tar.gz") as tar:
        assert any(n.endswith("cuda_tests.log") for n in tar.getnames())


@pytest.mark.process
def test_every_step_ran_or_was_cut_and_says_so(dry):
    _, out, _ = dry
    data = json.loads((out / "session.json").read_text())
    status = {s["name"]: s for s in data["steps"]}
    assert list(status) == [
        "versions", "dp_modes", "self_test", "smoke", "cuda_tests", "deadline_probe",
        "pipeline", "dp_compiled", "table2",
    ]  # fmt: skip
    assert status["deadline_probe"]["status"] == "cut" and "cap" in status["deadline_probe"]["note"]
    assert status["versions"]["status"] == "passed" and data["versions"]["opacus"]
    assert data["versions"]["mlflow"] is not None  # installed here, hidden from the steps
    for name, s in status.items():
        assert s["status"] in {"passed", "cut", "partial"}, (name, s)
    # the clipped sums of every mode were right (float64 against the per-example loop)
    assert status["dp_modes"]["status"] == "passed"
    assert all(r["check"]["ok"] for r in data["dp_modes"]["results"])
    # the compiled step (finetune.compile) too: bk-compiled's clipped sum in float64
    assert status["dp_compiled"]["status"] == "passed"
    (compiled,) = data["dp_compiled"]["results"]
    assert compiled["check"]["ok"] and "bk-compiled" in compiled["check"]["rel_error"]
    assert {"bk", "bk-compiled", "nonprivate-compiled"} <= set(compiled["modes"])
    # the self-test module by module (issue 66): every trained module's worst example, for the
    # mode and for the float32 reference, in a file of its own that comes back from a loan
    assert status["self_test"]["status"] == "passed"
    st = json.loads((out / "self_test.json").read_text())
    rows = st["modes"]["bk"]["record"]["by_module"]
    assert len(rows) > 10 and st["examples"] == 6 and st["commit"]
    for row in rows.values():
        assert 0 <= row["mode_example"] < 6 and 0 <= row["reference_example"] < 6
        assert 0 < row["mode_error"] < 1e-4 and row["how"]
    # the fixtures ran without MLflow: the CUDA test file's CPU tests passed, CUDA ones skipped
    tests = data["cuda_tests"]
    assert tests["passed"] > 0 and tests["failures"] == tests["errors"] == 0
    summary = (out / "summary.md").read_text()
    sections = ("## a.", "## b.", "## s.", "## c.", "## d.", "## e.", "| deadline_probe | cut |")
    for section in sections:
        assert section in summary


@pytest.mark.process
def test_steps_ran_without_mlflow_and_jobs_were_forked(dry):
    _, out, work = dry
    data = json.loads((out / "session.json").read_text())
    assert not list((work / "pipeline" / "results").glob("mlartifacts")), "MLflow was not hidden"
    pipe = data["pipeline"]
    if next(s for s in data["steps"] if s["name"] == "pipeline")["status"] == "passed":
        assert pipe["ok"], pipe
        assert any(j["forked"] for j in pipe["training_jobs"] if "/finetune/" in j["job"])


@pytest.mark.process
def test_a_cell_at_the_deadline_is_unfinished_never_a_result(dry):
    _, out, _ = dry
    t2 = json.loads((out / "session.json").read_text())["table2"]
    stalled = t2["cells"]["dpsgd-eps1-seed0"]  # the second cell run (the dry run stalls it)
    assert stalled["status"] == "cut" and "unfinished" in stalled["note"]
    assert "accuracy" not in stalled
    table = (out / "table2.md").read_text()
    assert "| dpsgd | 1 | 0 | cut: unfinished" in table
    for k, c in t2["cells"].items():  # every finished cell carries its numbers
        if c["status"] == "passed":
            eps = float(k.split("-eps")[1].split("-")[0])
            assert 0 <= c["accuracy"] <= 100 and c["epsilon_spent"] <= eps + 1e-6


@pytest.mark.process
def test_a_second_call_runs_only_the_missing_cells(dry):
    """The cells earlier loans finished (committed under docs/gpu-runs/cells) are skipped:
    the call starts with the next missing cells of the plan, and says what it skipped."""
    _, out, _ = dry
    t2 = json.loads((out / "session.json").read_text())["table2"]
    assert t2["done_before"] == ["dpsgd-eps3-seed0"]
    assert "dpsgd-eps3-seed0" not in t2["cells"]
    assert t2["cells"]["dpsat-eps3-seed0"]["status"] == "passed"
    assert "Finished in earlier loans and skipped (1" in (out / "summary.md").read_text()


def test_the_plan_runs_the_four_seed_0_cells_first_then_three_seeds_each():
    t2 = import_bench("gpu_session_table2")
    first = [("dpsgd", 3.0, 0), ("dpsat", 3.0, 0), ("dpsgd", 1.0, 0), ("dpsat", 1.0, 0)]
    assert list(t2.PLAN[:4]) == first
    assert {c[2] for c in t2.PLAN[4:12]} == {1, 2} and {c[:2] for c in t2.PLAN[4:12]} == {
        c[:2] for c in first
    }
    # every cell of the table (3 algorithms x 3 epsilons x 5 seeds) once
    assert len(t2.PLAN) == len(set(t2.PLAN)) == 45


@pytest.mark.process
def test_a_cell_starts_only_when_its_projection_fits(tmp_path):
    """After the first pair, a cell starts only if (measured time alone) x (cells sharing the
    GPU) ends before the deadline; otherwise it waits or is reported as not started."""
    import_bench("gpu_session_run")
    t2 = import_bench("gpu_session_table2")
    cells = t2.Cells(None, None, tmp_path, stall={t2.key(*c) for c in t2.PLAN}, parallel=4)
    sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
    cells.command = lambda a, e, s, m: (tmp_path, sleep)
    cells.pending = list(t2.PLAN[2:4])
    cells.outcomes = {"dpsgd-eps3-seed0": None, "dpsat-eps3-seed0": None}
    cells.alone_s = [100.0]
    cells.schedule(time.monotonic() + 150)  # one alone: 100 s fits; a second beside it: 200
    assert list(cells.running) == ["dpsgd-eps1-seed0"]
    assert cells.projection() == pytest.approx(200.0)
    cells.schedule(time.monotonic() + 150)
    assert list(cells.running) == ["dpsgd-eps1-seed0"]
    cells.stop_all("test")
    assert cells.outcomes["dpsgd-eps1-seed0"].status == "cut"


@pytest.mark.process
def test_a_cell_whose_self_test_refuses_the_mode_runs_again_in_hooks(tmp_path):
    """A device-only bug in the session's mode costs one cell's start, not the loan: the cell
    is queued again first, in hooks, and reported with the mode it ran in; any other failure
    is a failure."""
    import_bench("gpu_session_run")
    t2 = import_bench("gpu_session_table2")
    cells = t2.Cells(None, None, tmp_path, stall=set(), parallel=4, mode="bk")
    refuse = "import sys; print('PerSampleCheckError: sums differ'); sys.exit(1)"

    def command(algo, eps, seed, mode):
        if algo == "dpsgd" and mode == "bk":
            return tmp_path, [sys.executable, "-c", refuse]
        if algo == "dpsat":  # fails for another reason: no second try
            return tmp_path, [sys.executable, "-c", "raise SystemExit(3)"]
        return tmp_path, [sys.executable, "-c", "pass"]

    cells.command = command
    cells.pending = list(t2.PLAN[:2])
    end = time.monotonic() + 60
    while cells.pending or cells.running:
        cells.poll()
        cells.schedule(end)
        time.sleep(0.05)
    assert cells.modes == {"dpsgd-eps3-seed0": "hooks", "dpsat-eps3-seed0": "bk"}
    ok, bad = cells.outcomes["dpsgd-eps3-seed0"], cells.outcomes["dpsat-eps3-seed0"]
    assert ok.status == "passed" and "in hooks: the self-test refused bk" in ok.note
    assert ok.log.endswith("table2-dpsgd-eps3-seed0-hooks.log")
    assert bad.status == "failed" and "hooks" not in bad.note


def test_mode_on_the_command_line_is_table_2s_mode_over_step_b(tmp_path):
    """A loan's calls are short: step b in one call, Table 2 in the next with `--mode` read from
    the first; without `--mode`, step b's fastest mode whose sums were right, else bk."""
    import argparse

    session = import_bench("gpu_session")
    args = argparse.Namespace(
        dry_run=True, out=tmp_path / "out", work=tmp_path / "work", deadline=10.0, mode=None
    )
    s = session.Session(args)
    assert s.table2_mode()[0] == "bk"  # no step b
    ratios = {"bk": 5.85, "hooks": 3.58, "functorch": 8.52, "ew": 6.04}
    s.data["dp_modes"] = {
        "results": [
            {
                "model": "gnresnet10",
                "check": {"rel_error": dict.fromkeys(ratios, 0.0), "tolerance": 1e-9},
                "modes": {m: {"ratio": r} for m, r in ratios.items()},
            }
        ]
    }
    assert s.table2_mode()[0] == "hooks"
    args.mode = "bk"
    assert s.table2_mode() == ("bk", "--mode (step b of an earlier call)")
    with pytest.raises(SystemExit):
        session.main(["--dry-run", "--mode", "ghost"])  # not a mode a config can name
