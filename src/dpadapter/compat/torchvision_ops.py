"""Make `import torchvision` work when its compiled ops cannot load (CUDA wheel, CPU torch).

PyPI has no CPU build of torchvision 0.28; its `_C.so` then fails to load against the CPU torch,
and torchvision's import dies in `_meta_registrations` with "operator torchvision::nms does not
exist", taking `timm` with it. Nothing here needs the detection ops (NMS, RoI pooling, deformable
convolution), so when the extension cannot load we declare their schemas ourselves: the imports,
datasets, transforms and models then work, and calling one of those ops raises a clear
NotImplementedError instead. When the extension does load (the cluster's CUDA torch) this does
nothing. Hand-written because no library covers it; the schemas are copied from the operator
declarations that torchvision's C++ sources register.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from pathlib import Path

_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "roi_align(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, "
    "SymInt pooled_width, int sampling_ratio, bool aligned) -> Tensor",
    "_roi_align_backward(Tensor grad, Tensor rois, float spatial_scale, SymInt pooled_height, "
    "SymInt pooled_width, SymInt batch_size, SymInt channels, SymInt height, SymInt width, "
    "int sampling_ratio, bool aligned) -> Tensor",
    "qroi_align(Tensor input, Tensor rois, float input_scale, int input_zero_point, "
    "float rois_scale, int rois_zero_point, float spatial_scale, SymInt pooled_height, "
    "SymInt pooled_width, int sampling_ratio, bool aligned) -> Tensor",
    "ps_roi_align(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, "
    "SymInt pooled_width, int sampling_ratio) -> (Tensor, Tensor)",
    "_ps_roi_align_backward(Tensor grad, Tensor rois, Tensor channel_mapping, "
    "float spatial_scale, SymInt pooled_height, SymInt pooled_width, int sampling_ratio, "
    "SymInt batch_size, SymInt channels, SymInt height, SymInt width) -> Tensor",
    "roi_pool(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, "
    "SymInt pooled_width) -> (Tensor, Tensor)",
    "_roi_pool_backward(Tensor grad, Tensor rois, Tensor argmax, float spatial_scale, "
    "SymInt pooled_height, SymInt pooled_width, SymInt batch_size, SymInt channels, "
    "SymInt height, SymInt width) -> Tensor",
    "ps_roi_pool(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, "
    "SymInt pooled_width) -> (Tensor, Tensor)",
    "_ps_roi_pool_backward(Tensor grad, Tensor rois, Tensor channel_mapping, "
    "float spatial_scale, SymInt pooled_height, SymInt pooled_width, SymInt batch_size, "
    "SymInt channels, SymInt height, SymInt width) -> Tensor",
    "deform_conv2d(Tensor input, Tensor weight, Tensor offset, Tensor mask, Tensor bias, "
    "SymInt stride_h, SymInt stride_w, SymInt pad_h, SymInt pad_w, SymInt dilation_h, "
    "SymInt dilation_w, SymInt groups, SymInt offset_groups, bool use_mask) -> Tensor",
    "_deform_conv2d_backward(Tensor grad, Tensor input, Tensor weight, Tensor offset, "
    "Tensor mask, Tensor bias, SymInt stride_h, SymInt stride_w, SymInt pad_h, SymInt pad_w, "
    "SymInt dilation_h, SymInt dilation_w, SymInt groups, SymInt offset_groups, bool use_mask) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor)",
)

_state: dict[str, object] = {"done": False, "stubbed": False, "lib": None}


def _extension_path() -> Path | None:
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        for cand in Path(folder).glob("_C*.so"):
            return cand
    return None


def _unavailable(name: str):
    def kernel(*args, **kwargs):
        raise NotImplementedError(
            f"torchvision::{name} is unavailable: torchvision's compiled ops do not match this "
            "torch build (CPU torch with a CUDA torchvision wheel)"
        )

    return kernel


def ensure_torchvision_importable() -> bool:
    """Declare torchvision's op schemas if its extension cannot load. Returns True if stubbed."""
    if _state["done"]:
        return bool(_state["stubbed"])
    _state["done"] = True
    import torch

    path = _extension_path()
    if path is None:
        return False
    try:
        torch.ops.load_library(str(path))
        return False
    except (OSError, RuntimeError):
        pass
    lib = torch.library.Library("torchvision", "FRAGMENT")  # noqa: TOR901 - kept alive below
    for schema in _SCHEMAS:
        name = schema.split("(", 1)[0]
        if hasattr(torch.ops.torchvision, name):
            continue
        lib.define(schema)
        lib.impl(name, _unavailable(name), "CompositeExplicitAutograd")
    _state["lib"] = lib
    _state["stubbed"] = True
    return True


class _BeforeTorchvision(importlib.abc.MetaPathFinder):
    """Runs `ensure_torchvision_importable` when torchvision (or timm, which imports it) is
    first imported, then steps aside: `import dpadapter` stays free of torch (the workflow
    parses without it) and every later `import timm` still works."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname == "torchvision":
            remove_hook()
            ensure_torchvision_importable()
        return None  # the ordinary finders import it


_HOOK = _BeforeTorchvision()


def install_hook() -> None:
    """Declare the op schemas before torchvision's first import (at once if it is loaded)."""
    if "torchvision" in sys.modules:
        ensure_torchvision_importable()
    elif _HOOK not in sys.meta_path and not _state["done"]:
        sys.meta_path.insert(0, _HOOK)


def remove_hook() -> None:
    if _HOOK in sys.meta_path:
        sys.meta_path.remove(_HOOK)


def import_torchvision():
    ensure_torchvision_importable()
    import torchvision

    return torchvision
