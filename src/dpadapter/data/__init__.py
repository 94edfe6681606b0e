from dpadapter.data import sources as _sources  # noqa: F401  (registers the loaders)
from dpadapter.data.registry import (
    DATASETS,
    ArraySplit,
    DatasetUnavailable,
    load_dataset,
    register_dataset,
)
from dpadapter.data.tasks import RoleData, SplitPlan, build_splits

__all__ = [
    "DATASETS",
    "ArraySplit",
    "DatasetUnavailable",
    "RoleData",
    "SplitPlan",
    "build_splits",
    "load_dataset",
    "register_dataset",
]
