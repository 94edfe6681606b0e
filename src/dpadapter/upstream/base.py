"""Registry of upstream (pre-training) methods; `{upstream}` wildcard values are its names.

A method either starts from nothing (`needs_warmup = False`) or from the shared warm-up
checkpoint, which Snakemake computes once for all methods and all their hyperparameters.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from torch import nn

from dpadapter.data.tasks import RoleData, SplitPlan
from dpadapter.ground.param_schema import param_errors, params_object
from dpadapter.settings import Config, ModelConfig
from dpadapter.train.resume import ResumeFile

UPSTREAMS: dict[str, type[UpstreamMethod]] = {}


def register_upstream(name: str) -> Callable[[type[UpstreamMethod]], type[UpstreamMethod]]:
    def deco(cls: type[UpstreamMethod]) -> type[UpstreamMethod]:
        if name in UPSTREAMS:
            raise KeyError(f"upstream method {name!r} registered twice")
        cls.name = name
        UPSTREAMS[name] = cls
        return cls

    return deco


@dataclass
class UpstreamContext:
    cfg: Config
    plan: SplitPlan
    public: RoleData | None
    warmup_model: nn.Module | None
    seed: int
    log_epoch: Callable[[int, dict], None]
    # Where a method that trains keeps its resume state (None: no resuming, as in tests).
    resume: ResumeFile | None = None


class UpstreamMethod:
    name: ClassVar[str] = "base"
    needs_warmup: ClassVar[bool] = True
    needs_public_data: ClassVar[bool] = True
    # Whether the pretrain job reports accuracy on the public test split (its classes are the
    # head's); False for weights whose head was trained on other classes.
    public_report: ClassVar[bool] = True

    # JSON schema of `pretrain.params.<name>` (and of variant overrides): the config validation
    # refuses a typo or a wrong type before any job, and the constructor checks it again.
    params_schema: ClassVar[dict[str, Any]] = params_object()

    def __init__(self, params: dict[str, Any] | None = None):
        params = dict(params or {})
        problems = param_errors(self.params_schema, params, f"pretrain.params.{self.name}")
        if problems:
            raise ValueError(f"{self.name}: invalid parameters:\n  " + "\n  ".join(problems))
        self.params = {**self.default_params(), **params}

    @classmethod
    def default_params(cls) -> dict[str, Any]:
        return {}

    def build(self, ctx: UpstreamContext) -> nn.Module:
        raise NotImplementedError

    def checkpoint_model(self, ctx: UpstreamContext) -> tuple[ModelConfig | dict[str, Any], int]:
        """(model record, in_chans) the built model is rebuilt from (after `build`)."""
        return ctx.cfg.model, ctx.plan.in_chans

    def provenance(self) -> dict[str, Any] | None:
        """Where weights not trained here came from (source, sha256), after `build`."""
        return None
