"""Noise-robust pre-training (DPAdapter) and DP fine-tuning pipeline."""

from dpadapter.compat.torchvision_ops import ensure_torchvision_importable

# torchvision (and timm) must be importable before any submodule touches them.
ensure_torchvision_importable()

__version__ = "0.1.0"
