"""A ViT's own tokens (cls_token, reg_token, pos_embed) under bk: a closed form, no replay.

Their values against torch.func are in test_bookkeeping_any_module.py (float64, several token
layouts); here: the bk step of a ViT never replays the model (torch.func is not called for the
root) and PyTorch's warning about attention's slow batched fallback, which the replay raised,
is gone.
"""

from __future__ import annotations

import warnings

import pytest
import timm
import torch
from noiseless import dp_sgd  # tests/ is on sys.path

from dpadapter.per_sample import functional
from dpadapter.per_sample.bookkeeping import BookKeepingModule


def _step(model: torch.nn.Module) -> BookKeepingModule:
    bk = BookKeepingModule(model)
    opt = dp_sgd(bk, 1.0, 4, lr=0.1)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, 3, 32, 32, generator=g), torch.randint(0, 3, (4,), generator=g)
    torch.nn.functional.cross_entropy(bk(x), y).backward()
    opt.step()
    return bk


@pytest.mark.parametrize("kw", [{}, {"reg_tokens": 2, "no_embed_class": True}])
def test_a_vit_step_replays_nothing_and_warns_nothing(kw, monkeypatch):
    real = functional.module_grads

    def no_replay(module, *a, **k):  # small modules (timm's LayerNorm) may; the model not
        if isinstance(module, timm.models.vision_transformer.VisionTransformer):
            raise AssertionError("torch.func replay of the whole VisionTransformer")
        return real(module, *a, **k)

    monkeypatch.setattr(functional, "module_grads", no_replay)
    model = timm.create_model(
        "vit_tiny_patch16_224", img_size=32, patch_size=8, depth=1, num_classes=3, **kw
    )
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        bk = _step(model)
    assert bk.last_plan["<root>"] == "closed form (tokens)"
    assert not [w for w in seen if "performance drop" in str(w.message)], [
        str(w.message) for w in seen
    ]
