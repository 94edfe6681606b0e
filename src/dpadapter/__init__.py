"""Noise-robust pre-training (DPAdapter) and DP fine-tuning pipeline."""

from dpadapter.compat.torchvision_ops import install_hook

# torchvision (and timm) must be importable with a CPU torch: its op schemas are declared just
# before its first import (dpadapter.compat), so importing the package itself loads no torch.
install_hook()

__version__ = "0.1.0"
