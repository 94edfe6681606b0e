"""Noise-robust pre-training (DPAdapter) and DP fine-tuning pipeline."""

from dpadapter.compat.openmp import passive_wait_by_default
from dpadapter.compat.torchvision_ops import install_hook

# before any torch import: GNU OpenMP reads its wait policy once, at load (dpadapter.compat.openmp)
passive_wait_by_default()

# torchvision (and timm) must be importable with a CPU torch: its op schemas are declared just
# before its first import (dpadapter.compat), so importing the package itself loads no torch.
install_hook()

__version__ = "0.1.0"
