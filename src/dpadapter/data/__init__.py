from dpadapter.data import imagefolder as _imagefolder  # noqa: F401  (registers its family)
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
    "family_of",
    "public_train",
    "load_dataset",
    "missing_files",
    "register_dataset",
    "resolve_dataset",
]
