from dpadapter.algorithms import adpalloc as _adpalloc  # noqa: F401  (registers)
from dpadapter.algorithms import adpclip as _adpclip  # noqa: F401
from dpadapter.algorithms import dpsam as _dpsam  # noqa: F401
from dpadapter.algorithms import dpsat as _dpsat  # noqa: F401
from dpadapter.algorithms import dpsgd as _dpsgd  # noqa: F401
from dpadapter.algorithms import gep as _gep  # noqa: F401
from dpadapter.algorithms.base import (
    ALGORITHMS,
    AuditedStep,
    DPAlgorithm,
    DPRunSpec,
    Release,
    register_algorithm,
)

__all__ = [
    "ALGORITHMS",
    "AuditedStep",
    "DPAlgorithm",
    "DPRunSpec",
    "Release",
    "register_algorithm",
]
