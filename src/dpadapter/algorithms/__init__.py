"""The DP fine-tuning methods (layer 3), one upstream method per file, registered by name.

DP-SGD, GEP, AdpAlloc, AdpClip, DP-SAT and DP-SAM each override a phase of the shared base
(`base.DPAlgorithm`) and are found by name through `ALGORITHMS`. They may import the
per-sample layer (2) and everything below it; never the training loops (`train`), the stages
or any experiment built on them (the import-layer test walks every path from
`stages.finetune` through here).
"""

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
