"""How a job appears in MLflow: its run's name and tags, its stage's group run, the DP columns.

What the runs table shows of a job, and nothing that talks to a store: the names and tags here
are computed from the config and the job's wildcards, the DP params and metrics from its
metrics.json payload. The saved "DP runs" view (an experiment tag) and its URL live here too: the
columns it shows are the DP columns.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from dpadapter.settings import Config
from dpadapter.workflow.identity import config_hash, run_prefix
from dpadapter.workflow.reruns import SLOT_TAG, slot

# The group (parent) run of one stage of one config, and the job a run belongs to.
GROUP_TAG = "dpadapter.group"
JOB_TAG = "dpadapter.job"
# The job process of a run: "<pid>:<its start time>" (a pid alone may be reused), and its host.
PID_TAG, HOST_TAG = "dpadapter.process", "dpadapter.host"

# Wildcards in the order a run name reads them, and their tag names (the DP params' names).
_NAME_ORDER = ("algo", "mechanism", "strategy", "upstream", "task")
_TAG_OF = {"algo": "algorithm", "eps": "epsilon"}


def run_name(stage: str, wildcards: dict[str, str]) -> str:
    """`finetune dpsgd standard fmnist-same ε=1 s0`: what the runs table shows of a job."""
    w = dict(wildcards)
    parts = [stage, *(w.pop(k) for k in _NAME_ORDER if k in w)]
    seed = w.pop("seed", None)
    if "eps" in w:
        parts.append(f"ε={w.pop('eps')}")
    parts += [f"{k}={v}" for k, v in w.items()]
    if seed is not None:
        parts.append(f"s{seed}")
    return " ".join(parts)


@dataclass(frozen=True)
class Job:
    """How one job appears in MLflow: its run's name and tags, and its stage's group run."""

    name: str
    tags: dict[str, str]
    group: str
    group_name: str


def job(cfg: Config, stage: str, wildcards: dict[str, str]) -> Job:
    """The tags the UI groups and filters by (stage, upstream, task, algorithm, epsilon, seed,
    the config's hash); a stage's runs of one config share one group run (`hpo_trial` and
    `hpo_final` are `hpo`)."""
    h = config_hash(cfg)
    family = stage.split("_", 1)[0]
    tags = {
        "stage": stage,
        "config": h,
        "results_dir": cfg.results_dir,
        **{_TAG_OF.get(k, k): str(v) for k, v in wildcards.items()},
        JOB_TAG: "/".join([h, stage, *map(str, wildcards.values())]),
        SLOT_TAG: slot(cfg.results_dir, stage, wildcards),  # a rerun is numbered (reruns)
    }
    return Job(run_name(stage, wildcards), tags, f"{h}/{family}", f"{family} · {run_prefix(cfg)}")


# The columns that tell DP runs apart in the runs table, under the same names in every stage.
# Param name -> where it is found: the job's wildcards, metrics.json's `privacy` block, its
# `hyperparameters` block (first hit wins).
DP_PARAMS = {
    "target_epsilon": (("privacy", "target_epsilon"), ("wildcards", "eps")),
    "delta": (("privacy", "delta"),),
    "accountant": (("privacy", "accountant"),),
    "noise_multiplier": (("hyperparameters", "noise_multiplier"), ("privacy", "noise_multiplier")),
    "max_grad_norm": (("hyperparameters", "max_grad_norm"), ("privacy", "max_grad_norm")),
    "sample_rate": (("privacy", "sample_rate"), ("hyperparameters", "sample_rate")),
    "steps": (("privacy", "steps"),),
    "algorithm": (("hyperparameters", "algorithm"), ("wildcards", "algo")),
    "strategy": (("hyperparameters", "strategy"), ("wildcards", "strategy")),
    "upstream": (("wildcards", "upstream"), ("hyperparameters", "upstream")),
    "task": (("wildcards", "task"), ("hyperparameters", "task")),
    "seed": (("hyperparameters", "seed"), ("wildcards", "seed")),
}
# Metrics shown as columns: epsilon_spent is the accounted epsilon of metrics.json.
DP_METRICS = {
    "epsilon_spent": ("privacy", "epsilon"),
    "test_accuracy": ("test_accuracy",),
    "val_accuracy": ("val_accuracy",),
    "test_robust_accuracy": ("test_robust_accuracy",),
    "public_test_accuracy": ("public_test_accuracy",),
    "public_test_robust_accuracy": ("public_test_robust_accuracy",),
}


def _get(d: dict, path: tuple[str, ...]) -> Any:
    for k in path:
        if not isinstance(d, dict) or d.get(k) is None:
            return None
        d = d[k]
    return d


def dp_summary(metrics: dict[str, Any]) -> tuple[dict[str, Any], dict[str, float]]:
    """(params, metrics) of DP_PARAMS / DP_METRICS found in a job's metrics.json payload."""
    params = {}
    for name, paths in DP_PARAMS.items():
        value = next((v for v in (_get(metrics, p) for p in paths) if v is not None), None)
        if value is not None:
            params[name] = value
    values = {}
    for name, path in DP_METRICS.items():
        v = _get(metrics, path)
        if isinstance(v, int | float) and not isinstance(v, bool):
            values[name] = float(v)
    return params, values


# A saved view of the runs table with the DP columns. MLflow 3.17 opens an experiment on its GenAI
# overview and its runs table without metric or param columns (the UI keeps column choices in the
# browser); the saved view, an experiment tag in the envelope the UI's "Views" menu writes, is
# opened by `runs_url` (docs/tracking.md). Checked with headless Chromium in
# tests/cluster/test_mlflow_load.py.
DP_VIEW = "dp-runs"
_VIEW_METRICS = ("epsilon_spent", "test_accuracy", "val_accuracy", "test_robust_accuracy")
# ε spent beside its target, δ and the accountant that computed it (issue 50), then the rest
_VIEW_PARAMS = (
    "target_epsilon delta accountant noise_multiplier max_grad_norm sample_rate steps algorithm "
    "strategy"
)
_DP_COLUMNS = [f"metrics.`{m}`" for m in _VIEW_METRICS] + [
    f"params.`{p}`" for p in (_VIEW_PARAMS + " upstream task seed").split()
]
_VIEW_STATE = {"selectedColumns": _DP_COLUMNS, "orderByKey": "attributes.start_time"}
EXPERIMENT_TAGS = {
    # MLflow 3: the experiment holds training runs (not GenAI traces).
    "mlflow.experimentKind": "custom_model_development",
    f"mlflow.sharedViewState.{DP_VIEW}": json.dumps(
        {"name": "DP runs", "createdAt": 0, "updatedAt": 0, "state": json.dumps(_VIEW_STATE)}
    ),
}


def runs_url(base: str, experiment_id: str) -> str:
    """The experiment's runs table with the DP columns (epsilon, accuracies, privacy params)."""
    return f"{base.rstrip('/')}/#/experiments/{experiment_id}/runs?viewStateShareKey={DP_VIEW}"
