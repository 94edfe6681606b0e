# Validate the config against workflow/schemas/config.schema.yaml (plus the registries) before
# any job is scheduled, and define the grid every other rule file reads.
import hashlib
import json
import logging
import sys
from pathlib import Path

from snakemake.exceptions import WorkflowError
from snakemake.settings.types import DeploymentMethod

from dpadapter.config import ConfigError, from_dict
from dpadapter.upstream import UPSTREAMS as _UPSTREAM_REGISTRY
from dpadapter.upstream.variants import VARIANT_RE, parse_variant

try:
    CFG = from_dict(config)
except ConfigError as exc:
    raise WorkflowError(str(exc)) from None

# Opacus calls logging.basicConfig() at import, which would print every Snakemake message twice.
logging.root.handlers.clear()

RESULTS = CFG.results_dir
PYTHON = sys.executable
UPSTREAMS = list(CFG.upstreams)
TASKS = list(CFG.tasks)


def _effective_config() -> str:
    """The merged config (configfile + --config overrides) as a content-addressed file for jobs."""
    text = json.dumps(config, sort_keys=True, default=str)
    path = Path(RESULTS) / ".config" / f"{hashlib.sha256(text.encode()).hexdigest()[:16]}.json"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return str(path)


CONFIG_FILE = _effective_config()


def fingerprint(*keys):
    """Hash of the config sections a rule depends on; a params change makes Snakemake rerun it."""
    sub = {k: config.get(k) for k in keys}
    return hashlib.sha256(json.dumps(sub, sort_keys=True, default=str).encode()).hexdigest()[:16]


# Plumbing every shell command needs, passed as params (the linter wants no globals in shell
# commands). They are functions of `input`, which keeps them out of Snakemake's params rerun
# trigger: the interpreter path differs between machines and the content-addressed config file
# changes with any config section, while what a job depends on is its `fp` param.
def python_exe(wildcards, input):
    """The driver's interpreter (the .venv); under `--sdm conda`, that of the job's env."""
    if DeploymentMethod.CONDA in workflow.deployment_settings.deployment_method:
        return "python"
    return PYTHON


def config_file(wildcards, input):
    return CONFIG_FILE


def out_dir(wildcards, output):
    """The folder of a job's first output (the `--out` of every training stage)."""
    return str(Path(output[0]).parent)


# Fingerprints and inputs of the rules, kept here (the linter wants no functions in rule files).


def pretrain_fingerprint(wildcards):
    """Config a method depends on: shared sections, its own params and those of a matched method."""
    params = config.get("pretrain", {}).get("params", {})
    base = parse_variant(wildcards.upstream)[0]
    own = params.get(base, {})
    matched = params.get(own.get("match", "dpadapter"), {}) if base == "control" else {}
    return fingerprint("data", "public", "model", "seed", "robustness") + json.dumps(
        [own, matched], sort_keys=True
    )


def pretrain_inputs(wildcards):
    """Methods that build on the warm-up get its checkpoint; scratch gets nothing."""
    if _UPSTREAM_REGISTRY[parse_variant(wildcards.upstream)[0]].needs_warmup:
        return {"warmup": f"{RESULTS}/warmup/model.pt"}
    return {}


_GRID_KEYS = {"algorithms", "epsilons", "seeds", "extra_grids", "algo_params"}


def finetune_fingerprint(wildcards):
    """Settings one job depends on; the grid's extent (more seeds, another algorithm) is not one."""
    ft = {k: v for k, v in config.get("finetune", {}).items() if k not in _GRID_KEYS}
    algo = config.get("finetune", {}).get("algo_params", {}).get(wildcards.algo, {})
    task = config["tasks"][wildcards.task]
    return fingerprint("data", "privacy", "robustness", "public") + json.dumps(
        [ft, algo, task], sort_keys=True
    )


wildcard_constraints:
    upstream=VARIANT_RE,
    task="[a-z0-9][a-z0-9-]*",
    algo="[a-z0-9-]+",
    eps="[0-9]+(\\.[0-9]+)?(e-?[0-9]+)?",
    seed="[0-9]+",
