"""Compute-matched control: standard training continued exactly as long as another method.

DPAdapter (and SAM) train the warm-up model further; a downstream gain over `standard` could
then come from the extra training, not from parameter robustness. `control` continues the
warm-up model with plain SGD for the same schedule, the same number of update steps and the
same update batch size as the method it matches (default `dpadapter`, with that method's config
params), so the comparison isolates the perturbation. Measured here before this pipeline
existed (shared/notes/embedded-reference.md), such a control matched DPAdapter downstream.
"""

from __future__ import annotations

import copy
from typing import Any

from dpadapter.ground.param_schema import params_object
from dpadapter.train.loops import sgd_train
from dpadapter.upstream.base import UPSTREAMS, UpstreamContext, UpstreamMethod, register_upstream


@register_upstream("control")
class ComputeMatchedControl(UpstreamMethod):
    # `match` must name a method with an SGD schedule; dpadapter.validation.compose checks the name.
    params_schema = params_object(match={"type": "string"})

    @classmethod
    def default_params(cls) -> dict[str, Any]:
        return {"match": "dpadapter"}

    def build(self, ctx: UpstreamContext):
        target = self.params["match"]
        if target not in UPSTREAMS or not hasattr(UPSTREAMS[target], "sgd_config"):
            raise ValueError(f"control: cannot match {target!r}; it has no SGD schedule")
        if ctx.warmup_model is None or ctx.public is None:
            raise ValueError("control continues from the warm-up model on the public set")
        matched = UPSTREAMS[target](ctx.cfg.upstream_params.get(target))
        model = copy.deepcopy(ctx.warmup_model)
        model.train()
        # Same schedule, steps and update batch size as the matched method; plain SGD steps.
        sgd_train(
            model,
            ctx.public.train,
            matched.sgd_config(),
            seed=ctx.seed,
            on_epoch=ctx.log_epoch,
            desc="control",
            resume=ctx.resume,
            val=ctx.public.val,
        )
        return model
