"""dpadapter.workflow.snakemake_adapter against the installed Snakemake: each accessor read from a
real
run of a two-rule workflow, the version guard, and a moved internal said as what it is."""

from __future__ import annotations

import json
import re
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import snakemake_runner  # tests/ is on sys.path

from dpadapter.workflow import snakemake_adapter as smk

REPO = Path(__file__).resolve().parents[2]

# Every accessor, where the workflow calls it: at parse, in onstart and in onsuccess.
SNAKEFILE = textwrap.dedent(
    """
    import json
    from pathlib import Path
    from dpadapter.workflow import snakemake_adapter as smk

    smk.check_version()
    if not smk.replaces_default_config(workflow):
        configfile: "default.yaml"
    RECORD = Path("record.json")

    def record(**values):
        old = json.loads(RECORD.read_text()) if RECORD.exists() else {}
        RECORD.write_text(json.dumps({**old, **values}))

    record(parse={
        "config_files": smk.config_files(workflow),
        "replaces_default_config": smk.replaces_default_config(workflow),
        "config_overrides": smk.config_overrides(workflow),
        "is_main_process": smk.is_main_process(workflow),
        "config": dict(config),
    })

    rule all:
        input: "out/b.txt"

    rule a:
        output: "out/a.txt"
        threads: 2
        shell: "echo a > {output}"

    rule b:
        input: "out/a.txt"
        output: "out/b.txt"
        shell: "cat {input} > {output}"

    onstart:
        record(onstart={
            "uses_conda": smk.uses_conda(workflow),
            "runs_jobs_locally": smk.runs_jobs_locally(workflow),
            "jobs_to_run": smk.jobs_to_run(workflow, unknown=-1),
            "threads": smk.threads_of_jobs_to_run(workflow),
        })

    onsuccess:
        record(onsuccess={"finished_outputs": sorted(smk.finished_outputs(workflow))})
    """
)


def _snakemake(wd: Path, *args: str) -> dict:
    r = snakemake_runner.run(
        [sys.executable, "-m", "snakemake", "--cores", "1", *args],
        cwd=wd, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    record = wd / "record.json"
    values = json.loads(record.read_text())
    record.unlink()
    return values


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    (tmp_path / "Snakefile").write_text(SNAKEFILE)
    (tmp_path / "default.yaml").write_text("kk: 0\nkept: yes\n")
    (tmp_path / "mine.yaml").write_text("kk: 1\n")
    return tmp_path


@pytest.mark.slow
def test_each_accessor_reads_what_snakemake_was_told(workdir):
    # a dry run: parsed, but no handler runs (the config file of the jobs is written in onstart)
    dry = _snakemake(workdir, "-n", "--configfile", "mine.yaml", "--config", "kk=2")
    assert dry["parse"] == {
        "config_files": [str(workdir / "mine.yaml")],
        "replaces_default_config": True,
        "config_overrides": {"kk": 2},
        "is_main_process": True,
        "config": {"kk": 2},  # the embedded default.yaml was not loaded
    }
    assert set(dry) == {"parse"}
    run = _snakemake(workdir, "--configfile", "mine.yaml")
    assert run["onstart"] == {
        "uses_conda": False,
        "runs_jobs_locally": True,
        "jobs_to_run": 3,
        "threads": {"1": 3},  # a's threads: 2 capped at --cores 1 (JSON keys are strings)
    }
    assert run["onsuccess"] == {"finished_outputs": ["out/a.txt", "out/b.txt"]}
    # no --configfile: the directive's file; --until leaves jobs outdated, so no outputs
    (workdir / "out" / "a.txt").unlink()
    run = _snakemake(workdir, "--until", "a", "--cores", "2")  # the last --cores counts
    assert run["parse"]["config_files"] == ["default.yaml"]
    assert run["parse"]["replaces_default_config"] is False
    assert run["parse"]["config_overrides"] == {}
    assert run["onstart"]["jobs_to_run"] == 1
    assert run["onstart"]["threads"] == {"2": 1}  # a alone, at its 2 threads
    assert run["onsuccess"] == {"finished_outputs": []}


def test_the_pinned_snakemake_is_one_it_was_checked_on():
    import snakemake

    pin = re.search(r"^snakemake==(\S+)$", (REPO / "requirements.txt").read_text(), re.M)[1]
    assert pin in smk.CHECKED_ON
    assert smk.check_version() == snakemake.__version__ == pin


@pytest.mark.parametrize("version", ["9.26.0", "9.28.0", "10.0.0", "8.30.0"])
def test_a_version_it_was_not_checked_on_stops_the_workflow_with_what_to_do(version):
    with pytest.raises(SystemExit) as exc:
        smk.check_version(version)
    msg = str(exc.value)
    assert f"Snakemake {version} is not a version this workflow was checked on" in msg
    assert all(v in msg for v in smk.CHECKED_ON) and "make setup" in msg


def test_a_patch_release_of_a_checked_one_is_admitted():
    major, minor, patch = smk.CHECKED_ON[-1].split(".")
    assert smk.check_version(f"{major}.{minor}.{int(patch) + 1}")


def test_a_moved_internal_is_said_as_what_it_is():
    moved = SimpleNamespace(config_settings=SimpleNamespace())  # `config` renamed
    with pytest.raises(SystemExit, match=r"no `workflow\.config_settings\.config`"):
        smk.config_overrides(moved)


def test_conda_is_read_from_the_executor_plugin_interface():
    from snakemake_interface_executor_plugins.settings import DeploymentMethod

    def wf(*methods):
        return SimpleNamespace(deployment_settings=SimpleNamespace(deployment_method=set(methods)))

    assert smk.uses_conda(wf(DeploymentMethod.CONDA, DeploymentMethod.APPTAINER))
    assert not smk.uses_conda(wf(DeploymentMethod.APPTAINER))
    assert not smk.uses_conda(wf())
