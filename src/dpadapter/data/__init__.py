"""Registered datasets and the carving of the public set and the private tasks out of them.

The registry (`registry`, `sources`, `imagefolder`) declares each dataset's name, class counts
and file check without importing torch, so the config validation reads them while the workflow
parses; the task carving (`tasks`), which works on tensors, is imported on first use of its names.

Layer 1: it may import only the ground floor (`ground`, `settings`, `compat`), so the models,
the loops and the experiments above all read the same tasks.
"""

from dpadapter.data import imagefolder as _imagefolder  # noqa: F401  (registers its family)
from dpadapter.data import sklearn_digits as _sklearn_digits  # noqa: F401  (registers it)
from dpadapter.data import sources as _sources  # noqa: F401  (registers the loaders)
from dpadapter.data.registry import (
    DATASET_INFO,
    DATASETS,
    ArraySplit,
    DatasetInfo,
    DatasetUnavailable,
    family_of,
    load_dataset,
    missing_files,
    register_dataset,
    resolve_dataset,
)

_TASKS = ("RoleData", "SplitPlan", "build_splits", "public_train")

__all__ = [
    "DATASET_INFO",
    "DATASETS",
    "ArraySplit",
    "DatasetInfo",
    "DatasetUnavailable",
    "RoleData",
    "SplitPlan",
    "build_splits",
    "family_of",
    "public_train",
    "load_dataset",
    "missing_files",
    "register_dataset",
    "resolve_dataset",
]


def __getattr__(name: str):
    if name not in _TASKS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from dpadapter.data import tasks

    return getattr(tasks, name)
