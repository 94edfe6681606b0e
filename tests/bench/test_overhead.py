"""bench/cpu/overhead.py on a hand-made results tree: figures, gaps, errors, and its rule table
against the workflow's `benchmark:` directives (a rule added or moved there must show up here)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from bench_scripts import import_bench

ROOT = Path(__file__).resolve().parents[2]
HEADER = "s\th:m:s\tmax_rss\tmax_vms\tmax_uss\tmax_pss\tio_in\tio_out\tmean_load\tcpu_time"


@pytest.fixture(scope="module")
def overhead():
    return import_bench("overhead")


def bench(results: Path, rel: str, wall: float) -> None:
    path = results / "benchmarks" / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{HEADER}\n{wall:.2f}\t0:00:00\t1\t1\t1\t1\t0\t0\t50\t{wall / 2:.2f}\n")


def metrics(results: Path, rel: str, training: float | None) -> None:
    path = results / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {"stage": "x"} if training is None else {"stage": "x", "wall_time_s": training}
    path.write_text(json.dumps(body))


@pytest.fixture
def results(tmp_path):
    r = tmp_path / "results"
    bench(r, "warmup.tsv", 50.0)
    metrics(r, "warmup/metrics.json", 40.0)
    bench(r, "pretrain/standard.tsv", 100.0)
    metrics(r, "pretrain/standard/metrics.json", 90.0)
    bench(r, "pretrain/scratch.tsv", 10.0)
    metrics(r, "pretrain/scratch/metrics.json", 5.0)
    ft = "finetune/standard/fmnist-same/dpsgd/eps1"
    bench(r, f"{ft}/seed0.tsv", 20.0)
    metrics(r, f"{ft}/seed0/metrics.json", 15.0)
    bench(r, f"{ft}/seed1.tsv", 40.0)
    metrics(r, f"{ft}/seed1/metrics.json", 20.0)
    bench(r, f"{ft}/seed2.tsv", 30.0)  # killed before metrics.json
    bench(r, "audit/dpsgd/eps1.tsv", 8.0)  # writes audit.json, no metrics.json
    (r / "benchmarks" / "federated").mkdir(parents=True)  # a rule with no jobs
    return r


def rows_by_rule(overhead, results):
    jobs, unmatched = overhead.collect(results)
    return {rule: overhead.summarise(rule, js) for rule, js in jobs.items()}, unmatched


def test_figures_per_rule(overhead, results):
    rows, unmatched = rows_by_rule(overhead, results)
    assert list(rows) == ["warmup", "pretrain", "finetune", "audit_run"]  # workflow order
    assert unmatched == []
    w = rows["warmup"]
    assert (w.jobs, w.wall_mean_s, w.wall_max_s, w.training_mean_s) == (1, 50.0, 50.0, 40.0)
    assert w.overhead_mean == pytest.approx(0.2)
    assert w.overhead_of_sums == pytest.approx(0.2)
    p = rows["pretrain"]
    assert (p.jobs, p.wall_mean_s, p.wall_max_s, p.training_mean_s) == (2, 55.0, 100.0, 47.5)
    # per job 0.1 and 0.5; of the sums (110 - 95) / 110: the long job weighs more
    assert p.overhead_mean == pytest.approx(0.3)
    assert p.overhead_of_sums == pytest.approx(15 / 110)


def test_missing_metrics_leave_the_job_out_of_the_training_figures(overhead, results):
    rows, _ = rows_by_rule(overhead, results)
    f = rows["finetune"]
    assert (f.jobs, f.training_jobs) == (3, 2)
    assert f.wall_mean_s == pytest.approx(30.0)  # wall over all three jobs
    assert f.wall_max_s == 40.0
    assert f.training_mean_s == pytest.approx(17.5)
    assert f.overhead_mean == pytest.approx((0.25 + 0.5) / 2)
    assert f.overhead_of_sums == pytest.approx((60 - 35) / 60)
    a = rows["audit_run"]
    assert (a.jobs, a.training_jobs, a.wall_mean_s) == (1, 0, 8.0)
    assert a.training_mean_s is a.overhead_mean is a.overhead_of_sums is None


def test_metrics_without_wall_time_count_as_missing(overhead, results):
    metrics(results, "warmup/metrics.json", None)
    rows, _ = rows_by_rule(overhead, results)
    assert rows["warmup"].training_jobs == 0
    assert rows["warmup"].training_mean_s is None


def test_a_rule_with_no_jobs(overhead, results):
    rows, _ = rows_by_rule(overhead, results)
    assert "federated_run" not in rows
    empty = overhead.summarise("federated_run", [])
    assert (empty.jobs, empty.wall_sum_s, empty.training_jobs) == (0, 0, 0)
    assert empty.wall_mean_s is empty.wall_max_s is empty.overhead_of_sums is None
    # no benchmark file at all: a table that says so, not a division by zero
    bare = results.parent / "bare"
    (bare / "benchmarks").mkdir(parents=True)
    jobs, _ = overhead.collect(bare)
    assert jobs == {}
    assert "(no benchmark files)" in overhead.markdown([], [], None)


def test_table_and_json(overhead, results, tmp_path, capsys):
    out = tmp_path / "o" / "overhead.json"
    assert overhead.main([str(results), "--json", str(out)]) == 0
    table = capsys.readouterr().out
    lines = table.splitlines()
    assert lines[0].startswith("| rule | jobs |")
    assert "| warmup | 1 | 50.0 | 50.0 | 40.0 | 20.0 % | 20.0 % |" in lines
    assert "| finetune | 3 | 30.0 | 40.0 | 17.5 (2 of 3 jobs) | 37.5 % | 41.7 % |" in lines
    assert "| audit_run | 1 | 8.0 | 8.0 | - | - | - |" in lines
    assert any(line.startswith("| **all** | 7 |") for line in lines)
    data = json.loads(out.read_text())
    assert [r["rule"] for r in data["rules"]] == ["warmup", "pretrain", "finetune", "audit_run"]
    assert data["all"]["jobs"] == 7 and data["all"]["training_jobs"] == 5
    assert data["all"]["overhead_of_sums"] == pytest.approx((220 - 170) / 220)
    ft = data["rules"][2]["job_list"]
    assert {j["benchmark"]: j["training_s"] for j in ft}[
        "finetune/standard/fmnist-same/dpsgd/eps1/seed2.tsv"
    ] is None
    assert data["dry_run"] is None


def test_unmatched_files_are_listed_not_counted(overhead, results, capsys):
    bench(results, "somethingnew/x.tsv", 5.0)
    rows, unmatched = rows_by_rule(overhead, results)
    assert unmatched == ["somethingnew/x.tsv"]
    assert sum(r.jobs for r in rows.values()) == 7
    overhead.main([str(results)])
    assert "1 benchmark file(s) match no rule, left out: somethingnew/x.tsv" in (
        capsys.readouterr().out
    )


@pytest.mark.parametrize(
    "text, why",
    [
        ("", "empty benchmark file"),
        (HEADER + "\n", "header but no data row"),
        ("wall\tcpu\n1\t2\n", "no 's' column"),
        (HEADER + "\n12.5\t0:00:12\n", "row has 2 fields"),
        (HEADER.replace("\t", ",") + "\n1,2,3,4,5,6,7,8,9,10\n", "no 's' column"),
        (HEADER + "\nNA" + "\t1" * 9 + "\n", "'s' is not a number"),
    ],
)
def test_a_corrupt_benchmark_names_the_file(overhead, results, capsys, text, why):
    bad = results / "benchmarks" / "pretrain" / "standard.tsv"
    bad.write_text(text)
    with pytest.raises(overhead.OverheadError, match=why) as err:
        overhead.collect(results)
    assert str(bad) in str(err.value)
    assert overhead.main([str(results)]) == 2
    assert str(bad) in capsys.readouterr().err


def test_corrupt_metrics_and_missing_folder_name_the_file(overhead, results, capsys):
    bad = results / "warmup" / "metrics.json"
    bad.write_text("{not json")
    with pytest.raises(overhead.OverheadError, match=re.escape(str(bad))):
        overhead.collect(results)
    assert overhead.main([str(results.parent / "nothing")]) == 2
    assert "no benchmarks folder" in capsys.readouterr().err


# A stand-in for snakemake: it records its arguments and working folder, writes a file there
# (as Snakemake writes .snakemake/), and reads the results through the folder it was given.
FAKE = """
import json, os, sys, time
time.sleep(0.2)
os.makedirs(".snakemake", exist_ok=True)
open(".snakemake/state", "w").write("x")
json.dump({"argv": sys.argv[1:], "cwd": os.getcwd(), "entries": sorted(os.listdir(".")),
           "sees_results": os.path.isfile("results/benchmarks/warmup.tsv")},
          open(os.environ["FAKE_LOG"], "w"))
sys.exit(int(os.environ.get("FAKE_RC", "0")))
"""


@pytest.fixture
def project(tmp_path, results):
    """A project folder like the repository's: config, results, .snakemake and .dvc."""
    p = results.parent
    (p / "config.yaml").write_text("results_dir: results\n")
    (p / ".snakemake").mkdir()
    (p / ".dvc").mkdir()
    return p


@pytest.mark.process
def test_dry_run_is_timed_in_a_temporary_folder(overhead, project, tmp_path_factory, monkeypatch):
    log = tmp_path_factory.mktemp("fake") / "fake.json"  # outside the project
    monkeypatch.setenv("FAKE_LOG", str(log))
    before = sorted(p.relative_to(project) for p in project.rglob("*"))
    dry = overhead.time_dry_run(
        project / "config.yaml", project=project, command=[sys.executable, "-c", FAKE]
    )
    assert dry.returncode == 0
    assert 0.2 <= dry.wall_s < 30
    seen = json.loads(log.read_text())
    assert seen["argv"][:3] == ["-n", "--configfile", str(project / "config.yaml")]
    assert seen["argv"][3] == "-d" and seen["argv"][4] == seen["cwd"]
    assert Path(seen["cwd"]).resolve() != project.resolve()
    assert seen["sees_results"]  # the real results, through a link
    assert ".dvc" not in seen["entries"] and "config.yaml" in seen["entries"]
    assert not Path(seen["cwd"]).exists()  # removed afterwards
    # nothing written into the project: its own .snakemake is untouched
    assert sorted(p.relative_to(project) for p in project.rglob("*")) == before
    assert not (project / ".snakemake" / "state").exists()


@pytest.mark.process
def test_a_failed_dry_run_is_an_error(overhead, project, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FAKE_LOG", str(tmp_path / "fake.json"))
    monkeypatch.setenv("FAKE_RC", "3")
    with pytest.raises(overhead.OverheadError, match="exit 3"):
        overhead.time_dry_run(
            project / "config.yaml", project=project, command=[sys.executable, "-c", FAKE]
        )
    with pytest.raises(overhead.OverheadError, match="no such config"):
        overhead.time_dry_run(project / "missing.yaml", project=project, command=["true"])


@pytest.mark.process
def test_main_prints_the_dry_run(overhead, project, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FAKE_LOG", str(tmp_path / "fake.json"))
    real = overhead.time_dry_run
    monkeypatch.setattr(
        overhead,
        "time_dry_run",
        lambda config: real(config, project=project, command=[sys.executable, "-c", FAKE]),
    )
    out = tmp_path / "o.json"
    cfg = str(project / "config.yaml")
    assert (
        overhead.main([str(project / "results"), "--dry-run-config", cfg, "--json", str(out)]) == 0
    )
    assert re.search(
        r"`snakemake -n --configfile .*config.yaml`: \d+\.\d s wall", capsys.readouterr().out
    )
    assert json.loads(out.read_text())["dry_run"]["wall_s"] >= 0.2


# --- the rule table against workflow/rules/*.smk -------------------------------------------

SAMPLE = {"eps": "1", "seed": "0", "sweep": "1", "trial": "2", "point": "3", "rounds": "5"}


def _expand(text: str, variables: dict[str, str]) -> str:
    """An f-string of a rule file as a concrete path relative to RESULTS."""
    for _ in range(3):
        text = re.sub(r"(?<!\{)\{([A-Z_]+)\}(?!\})", lambda m: variables[m[1]], text)
    text = re.sub(r"\{\{(\w+)\}\}", lambda m: SAMPLE.get(m[1], f"{m[1]}-x"), text)
    assert "{" not in text, text
    return text


def workflow_rules() -> dict[str, tuple[str, str | None]]:
    """rule -> (benchmark path under benchmarks/, output `metrics=` under RESULTS or None)."""
    smk = sorted((ROOT / "workflow" / "rules").glob("*.smk"))
    variables = {"RESULTS": "RESULTS"}
    for f in smk:
        for name, value in re.findall(r'^([A-Z_]+) = f"([^"]*)"$', f.read_text(), re.M):
            variables[name] = value
    found = {}
    for f in smk:
        for block in re.split(r"^(?=rule \w+:)", f.read_text(), flags=re.M)[1:]:
            name = re.match(r"rule (\w+):", block)[1]
            b = re.search(r'^\s+benchmark:\s*\n\s+f"([^"]*)"', block, re.M)
            if not b:
                continue
            out = re.search(r"^\s+output:\s*\n((?:\s{8}.*\n)+)", block, re.M)
            m = re.search(r'metrics=f"([^"]*)"', out[1]) if out else None
            found[name] = (
                _expand(b[1], variables).removeprefix("RESULTS/benchmarks/"),
                _expand(m[1], variables).removeprefix("RESULTS/") if m else None,
            )
    return found


def test_rule_table_matches_the_workflow(overhead):
    rules = workflow_rules()
    assert set(rules) == {r for r, _, _ in overhead.RULES}
    assert len(rules) >= 8  # the parser found the rules at all
    for rule, (bench_path, metrics_path) in rules.items():
        assert overhead.match_rule(bench_path) == (rule, metrics_path), rule


def test_default_results_layout(overhead):
    # paths as a finished run of the default config lays them out
    assert overhead.match_rule("warmup.tsv") == ("warmup", "warmup/metrics.json")
    assert overhead.match_rule("finetune/dpadapter/fmnist-shift/dpsat/eps4/seed0.tsv") == (
        "finetune",
        "finetune/dpadapter/fmnist-shift/dpsat/eps4/seed0/metrics.json",
    )
    assert overhead.match_rule("hpo/a/b/c/seed0/final.tsv") == (
        "hpo_final",
        "hpo/a/b/c/seed0/linear_scaling/metrics.json",
    )
    assert overhead.match_rule("pretrain/x/y.tsv") is None


def test_the_phases_of_the_jobs_that_record_them(overhead, results):
    ft = results / "finetune/standard/fmnist-same/dpsgd/eps1"
    recorded = [
        {"private_steps": 8.0, "evaluation_robust": 2.0},
        {"private_steps": 12.0, "self_test": 1.0},
    ]
    for seed, phases in enumerate(recorded):
        m = json.loads((ft / f"seed{seed}/metrics.json").read_text())
        (ft / f"seed{seed}/metrics.json").write_text(json.dumps({**m, "timing_s": phases}))
    rows, _ = rows_by_rule(overhead, results)
    table = overhead.phase_table(list(rows.values()))
    text = "\n".join(table)
    # only the finetune rule records phases: two jobs of mean wall (20 + 40) / 2 = 30 s
    assert "Phases of the finetune jobs (2 jobs, mean wall 30.0 s)" in text
    assert "warmup jobs" not in text
    assert "| private_steps | 10.00 | 33.3 % |" in table
    assert "| evaluation_robust | 1.00 | 3.3 % |" in table  # a job without it counts 0
    assert "| self_test | 0.50 | 1.7 % |" in table
    assert "| (the rest: start-up, imports, MLflow, exit) | 18.50 | 61.7 % |" in table
    assert text in overhead.markdown(list(rows.values()), [], None)


def test_a_phase_table_that_is_not_seconds_names_the_file(overhead, results, capsys):
    path = results / "finetune/standard/fmnist-same/dpsgd/eps1/seed0/metrics.json"
    path.write_text(json.dumps({"wall_time_s": 1.0, "timing_s": {"private_steps": "slow"}}))
    assert overhead.main([str(results)]) == 2
    assert "seed0/metrics.json: timing_s is not a table of seconds" in capsys.readouterr().err
