# Validate the config against workflow/schemas/config.schema.yaml (plus the registries) before
# any job is scheduled, and define the grid every other rule file reads.
import hashlib
import json
import logging
import sys
from pathlib import Path

from snakemake.exceptions import WorkflowError

from dpadapter.config import ConfigError, from_dict
from dpadapter.upstream.variants import VARIANT_RE

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


wildcard_constraints:
    upstream=VARIANT_RE,
    task="[a-z0-9][a-z0-9-]*",
    algo="[a-z0-9-]+",
    eps="[0-9]+(\\.[0-9]+)?(e-?[0-9]+)?",
    seed="[0-9]+",
