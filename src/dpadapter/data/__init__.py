from dpadapter.data import sources as _sources  # noqa: F401  (registers the loaders)
from dpadapter.data.registry import (
    DATASET_INFO,
    DATASETS,
    ArraySplit,
    DatasetInfo,
    DatasetUnavailable,
    load_dataset,
    missing_files,
    register_dataset,
)
from dpadapter.data.tasks import RoleData, SplitPlan, build_splits, public_train

__all__ = [
    "DATASET_INFO",
    "DATASETS",
    "ArraySplit",
    "DatasetInfo",
    "DatasetUnavailable",
    "RoleData",
    "SplitPlan",
    "build_splits",
    "public_train",
    "load_dataset",
    "missing_files",
    "register_dataset",
]
