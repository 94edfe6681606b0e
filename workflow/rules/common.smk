# Validate the config against workflow/schemas/config.schema.yaml (plus the registries) before
# any job is scheduled, and define the grid every other rule file reads.
import hashlib
import json
import logging
import os
import sys
from pathlib import Path

from snakemake.exceptions import WorkflowError

from dpadapter.data.registry import data_fingerprint as _data_fingerprint
from dpadapter.ground import atomic as _atomic
from dpadapter import settings as _config
from dpadapter.workflow import dvc_sync as _dvc_sync
from dpadapter.workflow import identity as _identity
from dpadapter.workflow import keep as _keep
from dpadapter.launch import prefork as _prefork
from dpadapter.validation import optional_sections as _sections
from dpadapter.workflow import snakemake_adapter as _smk
from dpadapter import tracking as _tracking
from dpadapter.validation import compose as _validation
from dpadapter.workflow.fingerprint import stage_fingerprint
from dpadapter.upstream.resolve import method_class as _method_class
from dpadapter.upstream.resolve import weights_file as _weights_file
from dpadapter.upstream.variants import VARIANT_RE

# Opacus calls logging.basicConfig() at import, which would print every Snakemake message twice.
logging.root.handlers.clear()

# Every check (schema with each method's and algorithm's params schema, registry names, data
# sizes and files, privacy sanity) lives in dpadapter.validation.compose; see docs/validation.md. The
# user's files (--configfile, else the configfile directive) are read again for duplicate keys
# and the line of each problem. SystemExit prints the message once, as it is: a WorkflowError
# would be reported as an error of this file, with its line and a traceback.
# A config file with `base: <file>` is an overlay (dpadapter.settings.read_chain, docs/pipeline.md):
# Snakemake loaded only the overlay, so `config` is rebuilt from the merged chain (and --config
# on top) before anything reads it; rules see the merged dict. A plain file leaves `config`
# exactly as Snakemake loaded it.
# The optional sections (hpo, federated, sweeps, audit) never stop `make run`: their problems are
# said once as a warning (`section_warning`) and stop only their own targets, through
# `section_guard` in an input of each target rule (dpadapter.validation.optional_sections).
# What this file reads from Snakemake beyond its public interface comes through _smk
# (dpadapter.workflow.snakemake_adapter), which refuses a Snakemake it was not checked on.
_OVERRIDES = _smk.config_overrides(workflow)
_CONFIG_FILES = _smk.config_files(workflow)
try:
    if any(_config.uses_base(f) for f in _CONFIG_FILES):
        _merged = _config.read_files(_CONFIG_FILES, _OVERRIDES)
        config.clear()
        config.update(_merged)
    CFG, DEFERRED = _sections.validate_scoped(config, _CONFIG_FILES, _OVERRIDES, check_files=True)
except _validation.ConfigError as exc:
    raise SystemExit(str(exc)) from None
_WARNED = []


def section_warning(wildcards):
    """An input function of `all` and `report_all`: the sections they do not need but that have
    problems, said once (the targets are not known while the workflow is parsed)."""
    if DEFERRED and not _WARNED and _smk.is_main_process(workflow):
        _WARNED.append(True)
        print(_sections.warning(DEFERRED), file=sys.stderr)
    return []


def section_guard(target):
    """An input function of an optional section's target: it stops the run before any job
    while a section that target needs has problems (SystemExit prints them once, as the
    config's own problems are printed above)."""

    def guard(wildcards):
        refused = _sections.refusal(DEFERRED, target, config)
        if refused:
            raise SystemExit(refused)
        return []

    return guard


RESULTS = CFG.results_dir
PYTHON = sys.executable
UPSTREAMS = list(CFG.upstreams)
TASKS = list(CFG.grid_tasks())  # tasks with `grids: false` are for hpo/federated only

# A results folder holds one config's results (dpadapter.workflow.identity, docs/experiments.md): say so
# before anything is scheduled when it holds another config's; a real run (onstart below, never
# a dry run) refuses then unless DPADAPTER_ALLOW_OVERWRITE=1, else records this config.
_IDENTITY_WARNING = _identity.check(CFG)
# The folder's rerun-trigger version (dpadapter.workflow.fingerprint.CURRENT_VERSION for a new one): a
# folder built by older code keeps the triggers its finished jobs were built with.
FP_VERSION = _identity.fingerprint_version(CFG)
# ... with the upstream list its finished fine-tuning jobs were built with, for version 1
# (an added upstream adds jobs and reruns none there too; None for version 2).
FP_PINS = _identity.fingerprint_pins(CFG)
if _IDENTITY_WARNING:
    print(f"warning: {_IDENTITY_WARNING}", file=sys.stderr)

# The content of every dataset the config reads (dpadapter.data.data_fingerprint: hashes kept by
# path, size and mtime, so an unchanged folder costs a stat per file): part of the rerun trigger
# of each job that reads it, so an image added, removed or edited reruns exactly those jobs;
# said here when it changed since the folder's last run (dpadapter.workflow.identity). A folder
# begun before data triggers keeps its finished jobs' triggers: the datasets they were built
# from are left out there (identity.untriggered_data).
_UNTRIGGERED = _identity.untriggered_data(CFG)
DATA_FPS = {}
for _role in [CFG.public, *CFG.tasks.values()]:
    if _role.dataset not in _UNTRIGGERED and _role.dataset not in DATA_FPS:
        DATA_FPS[_role.dataset] = _data_fingerprint(_role.dataset, CFG.data.root)
_DATA_NOTE = _identity.data_changes(CFG, DATA_FPS)
if _DATA_NOTE and _smk.is_main_process(workflow):
    print(f"note: {_DATA_NOTE}", file=sys.stderr)


def job_fp(stage, wildcards=None):
    """The `fp` param of a `stage` job: the config it reads and, from version 3, its data."""
    return stage_fingerprint(config, stage, wildcards, FP_VERSION, FP_PINS, DATA_FPS)

# `dvc pull` restores files with times in no particular order; outputs that are exactly what
# dvc.lock records are put back into build order before Snakemake compares times
# (dpadapter.workflow.dvc_sync). A no-op outside a DVC project and inside `dvc repro`.
if _smk.is_main_process(workflow):
    _dvc_sync.restore_build_order(RESULTS)


_CONFIG_TEXT = json.dumps(config, sort_keys=True, default=str)
# The merged config (configfile + --config overrides) as a content-addressed file for jobs.
CONFIG_FILE = str(
    Path(RESULTS) / ".config" / f"{hashlib.sha256(_CONFIG_TEXT.encode()).hexdigest()[:16]}.json"
)


def _write_config_file():
    """Write CONFIG_FILE when jobs really run: from onstart, which Snakemake never calls in a dry
    run (`-n` writes nothing anywhere), before any job starts. Atomic, as another run of the
    same config may write it at once."""
    path = Path(CONFIG_FILE)
    if not path.exists():
        _atomic.write_text(path, _CONFIG_TEXT)


# Plumbing every shell command needs, passed as params (the linter wants no globals in shell
# commands). They are functions of `input`, which keeps them out of Snakemake's params rerun
# trigger: the interpreter path differs between machines and the content-addressed config file
# changes with any config section, while what a job depends on is its `fp` param.
def python_exe(wildcards, input):
    """The driver's interpreter (the .venv); under `--sdm conda`, that of the job's env."""
    if _smk.uses_conda(workflow):
        return "python"
    return PYTHON


def config_file(wildcards, input):
    return CONFIG_FILE


def out_dir(wildcards, output):
    """The folder of a job's first output (the `--out` of every training stage)."""
    return str(Path(output[0]).parent)


# The lines every job's rule shares come from here (`snakemake --lint` reads this file as text,
# so no colon follows the word "rule" on one line):
#   conda      PIPELINE_ENV, its env under `--sdm conda`
#   params     **JOB_PARAMS, the plumbing above, then the rule's own
#   resources  **cpu_job(...) or **gpu_job(...) (gpus=FINETUNE_GPUS or PRETRAIN_GPUS)
# A rule's own params and its shell command stay in its file, unchanged: a changed params value
# or command would rerun every finished job of the rule (Snakemake's rerun triggers).
PIPELINE_ENV = "../../envs/pipeline.yaml"  # relative to the rule files, as Snakemake reads it
JOB_PARAMS = {"python": python_exe, "config": config_file}


def cpu_job(mem_mb=1000, runtime=10):
    """Resources of a job without a GPU: MB of memory, minutes of wall time (Slurm's limits;
    the Slurm profile's `set-resources` may raise them)."""
    return {"gpu": 0, "mem_mb": mem_mb, "runtime": runtime}


def gpu_job(mem_mb, runtime, gpus=1):
    """Resources of a job that trains on `gpus` GPUs of one node (the Slurm profile sends it to
    a GPU partition: tests/cluster/test_slurm_profile.py). Under the slurm executor plugin
    `gpu` becomes `sbatch --gpus=<gpus>` and `nodes` `--nodes=1` (the GPUs of a k-process
    fine-tuning job on one node, where torchrun's standalone rendezvous finds them all).
    `gpu_jobs` counts the job once, whatever its GPUs: the profile's limit inside a group
    allocation (`resources: gpu_jobs=1`, scope local) lets its jobs take turns, so the group asks
    for the GPUs of its largest job, not for their sum (docs/cluster.md, "Grouped jobs")."""
    return {"gpu": gpus, "gpu_jobs": 1, "nodes": 1, "mem_mb": mem_mb, "runtime": runtime}


# GPUs of one fine-tuning job: one per process (`finetune.processes`, dpadapter.ground.distributed).
# GPUs of a DP training job (fine-tuning, the HPO's trials, final runs and baselines) and of a
# warm-up or pre-training job: their processes under torchrun (dpadapter.ground.distributed)
FINETUNE_GPUS = CFG.finetune.processes
PRETRAIN_GPUS = CFG.pretrain_processes


# Inputs of the rules, kept here (the linter wants no functions in rule files). Their `fp`
# params, the rerun triggers, come from dpadapter.workflow.fingerprint.stage_fingerprint.


def pretrain_inputs(wildcards):
    """Methods that build on the warm-up get its checkpoint; scratch gets nothing; an external
    upstream with a local weights file gets that file (a changed file reruns the job).

    A variant asked for on the command line (`results/pretrain/dpadapter+gama=1/...`) is
    checked against the method's params schema here, while the DAG is built, before any job.
    Names resolve as the jobs resolve them (dpadapter.upstream.resolve: labels of
    `pretrain.external` too).
    """
    problems = _validation.variant_problems(
        wildcards.upstream, CFG.upstream_params, "{upstream} wildcard", CFG.external_upstreams
    )
    if problems:
        raise WorkflowError("invalid upstream variant:\n" + "\n".join(problems))
    inputs = {}
    if _method_class(CFG, wildcards.upstream).needs_warmup:
        inputs["warmup"] = f"{RESULTS}/warmup/model.pt"
    weights = _weights_file(CFG, wildcards.upstream)
    if weights is not None:
        inputs["weights"] = weights
    return inputs


wildcard_constraints:
    upstream=VARIANT_RE,
    task="[a-z0-9][a-z0-9-]*",
    algo="[a-z0-9-]+",
    eps="[0-9]+(\\.[0-9]+)?(e-?[0-9]+)?",
    seed="[0-9]+",


# The fork servers this run started, and stops (none where it uses a parent's: `onstart`).
_OWN_SERVERS = []


# The outputs a run's jobs will replace, kept until it ends (dpadapter.workflow.keep).
_KEPT = []


onstart:
    _identity.before_run(CFG, DATA_FPS)
    # a rerun that fails gets its previous outputs back in onerror
    _KEPT.append(
        _keep.keep(
            RESULTS, _smk.outputs_to_run(workflow), lambda p: _smk.metadata_record(workflow, p)
        )
    )
    _write_config_file()
    # The effective config (bases merged, --config applied) beside the results it produced.
    _config.write_merged(config, RESULTS, _CONFIG_FILES)
    # `tracking.enabled: true` without a working MLflow stops here, before any job.
    _tracking.check(CFG)
    # A local run's jobs start from one process that has imported torch, Opacus and MLflow
    # (dpadapter.launch.prefork; DPADAPTER_PREFORK=0 turns it off); a cluster's jobs start their own.
    # Not for a run of one job: it would only wait for the server's imports instead of its own.
    if (
        _smk.runs_jobs_locally(workflow)
        and not _smk.uses_conda(workflow)
        and _smk.jobs_to_run(workflow, unknown=_prefork.MIN_JOBS) >= _prefork.MIN_JOBS
    ):
        # One server per thread count that at least MIN_JOBS of the jobs ask for besides the
        # training rules' one thread (warm-up and pre-training take workflow.cores): a job
        # finds the server of its own count in the socket list.
        _threads = _smk.threads_of_jobs_to_run(workflow)
        _wanted = sorted({1} | {k for k, n in _threads.items() if n >= _prefork.MIN_JOBS})
        # servers a parent started for many runs (the test suite's) serve this one too
        if _prefork.inherited(os.environ.get(_prefork.ENV), _wanted) is None:
            _sockets = [
                _prefork.start(PYTHON, f"{RESULTS}/logs/prefork.log", threads=k) for k in _wanted
            ]
            if all(_sockets):
                os.environ[_prefork.ENV] = os.pathsep.join(_sockets)
                _OWN_SERVERS.extend(_sockets)


# Record what a successful run built in dvc.lock, so `dvc push` uploads it (dpadapter.workflow.dvc_sync).
onsuccess:
    _keep.discard(_KEPT[0] if _KEPT else None)
    _prefork.stop(os.pathsep.join(_OWN_SERVERS))
    if _OWN_SERVERS:
        os.environ.pop(_prefork.ENV, None)
    _dvc_sync.commit(RESULTS, _smk.finished_outputs(workflow))


onerror:
    _restored = _keep.restore(
        _KEPT[0] if _KEPT else None, lambda p, r: _smk.put_metadata_record(workflow, p, r)
    )
    if _restored:
        print(
            f"kept: the previous outputs of the failed jobs are back ({len(_restored)} files, "
            f"e.g. {_restored[0]}); they are still outdated and rerun next time",
            file=sys.stderr,
        )
    _prefork.stop(os.pathsep.join(_OWN_SERVERS))
    if _OWN_SERVERS:
        os.environ.pop(_prefork.ENV, None)
