"""What the workflow reads from Snakemake beyond its public interface, in one place.

The rule files use Snakemake's documented surface everywhere else (`config`, `--configfile`,
`--config`, `workflow.cores`, the onstart/onsuccess/onerror handlers, profiles). What follows
has no public equivalent; each item is read from the `workflow` object of a Snakefile here and
nowhere else, so a Snakemake release that moves one breaks this module, with a message, instead
of the pipeline in the middle of a run.

- `config_files`, `replaces_default_config`: the files given with `--configfile` (the workflow
  reads them again for `base:` overlays, duplicate keys and the line of each problem; and
  `--configfile` replaces the embedded config.yaml instead of being merged into it).
- `config_overrides`: the `--config KEY=VALUE` pairs alone, put back on top of a merged
  overlay chain and named as the origin of a value in a config problem.
- `is_main_process`: the process the user started, not a job's (a cluster job parses the
  Snakefile again; warnings and the DVC time fix-up belong to the first only).
- `uses_conda`: `--sdm conda` (jobs then run the `python` of their env, not the driver's).
  Read through the executor plugin interface (snakemake-interface-executor-plugins, versioned).
- `runs_jobs_locally`, `jobs_to_run`: whether the jobs run on this machine, and how many will
  (the prefork server starts only for a local run of enough jobs).
- `finished_outputs`: the outputs of every job of a finished run (recorded in dvc.lock).
- `outputs_to_run`, `metadata_record`, `put_metadata_record`: the outputs of each job a run
  will start, and Snakemake's record of how an output was built (its params, the rerun
  trigger), kept with the previous outputs so a failed rerun puts both back
  (`dpadapter.workflow.keep`).

Checked on the Snakemake versions in `CHECKED_ON` (requirements.txt pins one of them);
`check_version` refuses any other minor release before the workflow reads anything, with what to
do. To admit a new release: run tests/workflow/test_snakemake_adapter.py under it, and add it here.
"""

from __future__ import annotations

from typing import Any

# Every release this module was checked on (tests/workflow/test_snakemake_adapter.py): its
# patch releases are admitted too, nothing else.
CHECKED_ON = ("9.27.1",)


class SnakemakeAdapterError(SystemExit):
    """Snakemake is not one this workflow was checked on, or one of its internals moved.

    A SystemExit, as the workflow's config problems: Snakemake stops and prints the message once,
    as it is, not as an error of a rule file with its traceback."""


def _minor(version: str) -> tuple[str, ...]:
    return tuple(version.split("+", 1)[0].split(".")[:2])


def check_version(version: str | None = None) -> str:
    """The running Snakemake's version, refused unless a patch release of one in CHECKED_ON."""
    if version is None:
        import snakemake

        version = snakemake.__version__
    if _minor(version) not in {_minor(v) for v in CHECKED_ON}:
        raise SnakemakeAdapterError(
            f"Snakemake {version} is not a version this workflow was checked on "
            f"({', '.join(CHECKED_ON)}): the workflow reads a few of Snakemake's internals "
            f"(listed in {__file__}), which may have moved. Install the pinned version "
            "(`make setup`, requirements.txt), or check each of them under "
            f"{version} (tests/workflow/test_snakemake_adapter.py) and add it to CHECKED_ON."
        )
    return version


def _read(workflow: Any, path: str) -> Any:
    """`workflow.<path>`; a missing attribute is said as what it is, not as an AttributeError
    deep inside a rule file."""
    obj = workflow
    for name in path.split("."):
        try:
            obj = getattr(obj, name)
        except AttributeError:
            raise SnakemakeAdapterError(
                f"this Snakemake has no `workflow.{path}` (checked on {', '.join(CHECKED_ON)}); "
                f"see {__file__}"
            ) from None
    return obj


def config_files(workflow: Any) -> list[str]:
    """The config files loaded: those of `--configfile`, else the `configfile:` directive's."""
    return [str(f) for f in _read(workflow, "configfiles")]


def replaces_default_config(workflow: Any) -> bool:
    """Whether `--configfile` was given (then the embedded config.yaml is not loaded at all)."""
    return bool(_read(workflow, "overwrite_configfiles"))


def config_overrides(workflow: Any) -> dict[str, Any]:
    """The `--config KEY=VALUE` pairs, without the config files' values."""
    return dict(_read(workflow, "config_settings.config"))


def is_main_process(workflow: Any) -> bool:
    """True in the `snakemake` the user started; False in a job's own (cluster, group jobs)."""
    return bool(_read(workflow, "is_main_process"))


def uses_conda(workflow: Any) -> bool:
    """Whether jobs run in conda envs (`--sdm conda`)."""
    from snakemake_interface_executor_plugins.settings import DeploymentMethod

    return DeploymentMethod.CONDA in _read(workflow, "deployment_settings.deployment_method")


def runs_jobs_locally(workflow: Any) -> bool:
    """Whether this process starts the jobs on this machine (no cluster executor, not a job)."""
    return bool(_read(workflow, "local_exec")) and not _read(workflow, "remote_exec")


def jobs_to_run(workflow: Any, unknown: int) -> int:
    """How many jobs this run will start (in onstart, once the DAG is built); `unknown` where
    the DAG cannot say."""
    try:
        return sum(1 for _ in _read(workflow, "dag").needrun_jobs())
    except Exception:
        return unknown


def threads_of_jobs_to_run(workflow: Any) -> dict[int, int]:
    """How many of this run's jobs ask for each number of threads (in onstart); {} where the
    DAG cannot say."""
    counts: dict[int, int] = {}
    try:
        for job in _read(workflow, "dag").needrun_jobs():
            counts[int(job.threads)] = counts.get(int(job.threads), 0) + 1
    except Exception:
        return {}
    return counts


def finished_outputs(workflow: Any) -> list[str]:
    """Outputs of every job of the finished run (all built or up to date, in onsuccess); none
    after --until/--omit-from, which leave jobs below them outdated."""
    if _read(workflow, "dag_settings.until") or _read(workflow, "dag_settings.omit_from"):
        return []
    return [str(f) for job in _read(workflow, "dag.jobs") for f in job.output]


def outputs_to_run(workflow: Any) -> list[list[str]]:
    """The outputs of each job this run will start (in onstart, once the DAG is built)."""
    return [[str(f) for f in job.output] for job in _read(workflow, "dag").needrun_jobs()]


def metadata_record(workflow: Any, path: str) -> Any:
    """Snakemake's record of how `path` was built (None if it has none)."""
    return _read(workflow, "persistence")._read_record(path)


def put_metadata_record(workflow: Any, path: str, record: Any) -> None:
    """Put back a record `metadata_record` read (a restored output is judged as it was)."""
    _read(workflow, "persistence")._write_record(path, record)
