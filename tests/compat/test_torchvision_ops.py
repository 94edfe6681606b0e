"""torchvision (and timm) must import and work with the CPU torch despite the CUDA extension."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dpadapter.compat.torchvision_ops import ensure_torchvision_importable, import_torchvision


@pytest.mark.process
def test_plain_import_of_timm_fails_without_the_shim_and_works_with_it():
    # A fresh interpreter without the venv's .pth files (-S, site-packages put on the path by
    # hand) shows the failure the shim exists for (only where the extension cannot load; on a
    # matching build every import succeeds and the shim does nothing).
    import sysconfig

    bare = f"import sys; sys.path.append({sysconfig.get_paths()['purelib']!r}); import timm"
    plain = subprocess.run([sys.executable, "-S", "-c", bare], capture_output=True, text=True)
    fixed = subprocess.run(
        [sys.executable, "-c", "import dpadapter, timm; print(timm.__version__)"],
        capture_output=True,
        text=True,
    )
    assert fixed.returncode == 0, fixed.stderr
    if ensure_torchvision_importable():
        assert plain.returncode != 0 and "torchvision::nms" in plain.stderr


@pytest.mark.process
def test_plain_import_of_timm_works_in_the_projects_venv():
    """`make setup` installs a .pth that imports the shim at start (tools/install_compat_pth.py),
    so `import timm` works on its own, as a user expects."""
    venv_python = Path(__file__).resolve().parents[2] / ".venv" / "bin" / "python"
    if Path(sys.prefix).resolve() != venv_python.parent.parent.resolve():
        pytest.skip(f"not the project's venv ({sys.prefix}): the .pth is the venv's set-up")
    plain = subprocess.run(
        [sys.executable, "-c", "import timm; timm.create_model('resnet10t')"],
        capture_output=True,
        text=True,
    )
    assert plain.returncode == 0, plain.stderr[-2000:]


def test_datasets_transforms_and_timm_models_work():
    tv = import_torchvision()
    import timm

    t = tv.transforms.Compose([tv.transforms.ToTensor(), tv.transforms.Normalize((0.5,), (0.5,))])
    import numpy as np
    from PIL import Image

    img = Image.fromarray(np.zeros((28, 28), dtype=np.uint8))
    assert t(img).shape == (1, 28, 28)
    assert hasattr(tv.datasets, "FashionMNIST") and hasattr(tv.datasets, "CIFAR10")
    m = timm.create_model("resnet18", pretrained=False, num_classes=3, in_chans=1)
    assert m(torch.zeros(2, 1, 32, 32)).shape == (2, 3)


def test_detection_ops_raise_a_clear_error_when_stubbed():
    if not ensure_torchvision_importable():
        return  # real extension loaded: the op works and there is nothing to check here
    import pytest

    with pytest.raises(NotImplementedError, match="unavailable"):
        torch.ops.torchvision.nms(torch.zeros(1, 4), torch.zeros(1), 0.5)
