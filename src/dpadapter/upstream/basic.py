"""The two baselines of Table 1 that need no extra training: scratch and standard."""

from __future__ import annotations

from dpadapter.models import create_model
from dpadapter.upstream.base import UpstreamContext, UpstreamMethod, register_upstream


@register_upstream("scratch")
class Scratch(UpstreamMethod):
    """Random initialisation (seeded); sees no public data."""

    needs_warmup = False
    needs_public_data = False

    def build(self, ctx: UpstreamContext):
        n_classes = len(ctx.plan.allocations["public"].classes)
        return create_model(ctx.cfg.model, n_classes, ctx.plan.in_chans, ctx.seed)


@register_upstream("standard")
class Standard(UpstreamMethod):
    """Standard pre-training: the shared warm-up checkpoint, unchanged."""

    def build(self, ctx: UpstreamContext):
        assert ctx.warmup_model is not None
        return ctx.warmup_model
