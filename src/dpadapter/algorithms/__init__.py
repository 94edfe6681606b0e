from dpadapter.algorithms import dpsgd as _dpsgd  # noqa: F401  (registers)
from dpadapter.algorithms.base import ALGORITHMS, DPAlgorithm, DPRunSpec, register_algorithm

__all__ = ["ALGORITHMS", "DPAlgorithm", "DPRunSpec", "register_algorithm"]
