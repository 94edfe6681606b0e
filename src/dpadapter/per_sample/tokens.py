"""Per-example gradients of a ViT's own tokens in closed form, for book-keeping (bk).

A timm VisionTransformer owns `cls_token`, `reg_token` and `pos_embed` itself. bk has no layer
rule for its root, so it used to take their per-example gradients by torch.func, replaying the
whole model once per example under `vmap` (a second forward and backward of every block; PyTorch
also warns that attention falls back to its slow path there). None of that is needed: the
tokens enter the model in one place, `_pos_embed`, by concatenation and addition, so each
example's gradient of them is a slice of the gradient at `_pos_embed`'s output (the input of its
`pos_drop`):

- `x = cat(cls, reg, patches) + pos_embed` (timm's default): pos_embed's gradient is the whole
  output gradient g_i, cls_token's is g_i[0], reg_token's g_i[1 : 1 + R];
- `no_embed_class` (DeiT-3): `cat(cls, reg, patches + pos_embed)`: pos_embed's is g_i[prefix:].

Used only where that layout is certain: the module's `_pos_embed` is timm's VisionTransformer
one, it owns no other parameter, and it does not resample its position embedding
(`dynamic_img_size`); any other module keeps the torch.func path. Checked in float64 against a
whole-model torch.func reference (tests/per_sample/test_vit_tokens.py). Hand-written: neither Opacus
nor fastDP has a rule for a ViT's tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

TOKEN_PARAMS = frozenset({"cls_token", "reg_token", "pos_embed"})


@dataclass(frozen=True)
class TokenLayout:
    """Where each token parameter sits in `_pos_embed`'s output (tokens along dim 1)."""

    cls: bool
    reg: int
    pos_all: bool  # pos_embed covers the prefix tokens too (not `no_embed_class`)

    @property
    def prefix(self) -> int:
        return int(self.cls) + self.reg

    def grads(self, g: torch.Tensor, params: dict[str, nn.Parameter]) -> dict[str, torch.Tensor]:
        """{name: (n, *p.shape)} from the output gradient g (n, tokens, dim)."""
        n = g.shape[0]
        out = {}
        for name, p in params.items():
            if name == "cls_token":
                part = g[:, :1]
            elif name == "reg_token":
                part = g[:, int(self.cls) : self.prefix]
            else:
                part = g if self.pos_all else g[:, self.prefix :]
            out[name] = part.reshape(n, *p.shape)
        return out


def token_layout(m: nn.Module) -> TokenLayout | None:
    """The layout of `m`'s tokens when the closed form applies to it, else None."""
    own = {n for n, _ in m.named_parameters(recurse=False)}
    if not own or not own <= TOKEN_PARAMS or getattr(m, "dynamic_img_size", True):
        return None
    if not isinstance(getattr(m, "pos_drop", None), nn.Module):
        return None
    pos_embed = getattr(type(m), "_pos_embed", None)
    if pos_embed is None or pos_embed.__qualname__ != "VisionTransformer._pos_embed":
        return None
    if pos_embed.__module__ != "timm.models.vision_transformer":
        return None
    reg = getattr(m, "reg_token", None)
    return TokenLayout(
        cls=getattr(m, "cls_token", None) is not None,
        reg=0 if reg is None else int(reg.shape[1]),
        pos_all=not getattr(m, "no_embed_class", False),
    )
