"""DP-SGD: the shared base unchanged; registered under its own name."""

from dpadapter.algorithms.base import DPAlgorithm, register_algorithm


@register_algorithm("dpsgd")
class DPSGD(DPAlgorithm):
    """Abadi et al. 2016: clip each example's gradient to C, add N(0, sigma^2 C^2)."""
