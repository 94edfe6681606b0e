"""DP-SAT (Park et al. 2023, Algorithm 1) and its momentum variant (Appendix G.1).

The ascent direction is the previous step's privatized gradient, so the ascent is
post-processing of a past release and costs no privacy (Theorem 4.2): the step is DP-SGD's
single subsampled Gaussian, evaluated at perturbed weights, and the ledger records it as such.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from opacus.optimizers import DPOptimizer
from torch import nn

from dpadapter.algorithms.base import DPAlgorithm, all_params, global_norm, register_algorithm
from dpadapter.ground.device import Place
from dpadapter.ground.param_schema import (
    FRACTION,
    NON_NEGATIVE,
    by_epsilon,
    nullable,
    params_object,
)


@register_algorithm("dpsat")
class DPSAT(DPAlgorithm):
    """Ascent w + rho * g~_{t-1} / ||g~_{t-1}||, DP gradient there, update from the unperturbed w.

    The perturbation is applied once per logical batch (before its first physical batch) and kept
    for all of them, so every per-sample gradient of the logical batch is taken at the same
    perturbed point; the weights are restored by copy (exactly) in the step hook, after the noise
    and before the base optimizer's update, i.e. only once the logical batch has ended. The
    public DPSAT code leaves the perturbation in the weights when a logical batch spans several
    physical batches, so its weights drift even at lr 0 and sigma 0 (tests/algorithms checks
    that they do not drift here).
    The first step has no previous release and takes a plain DP-SGD step.
    """

    params_schema = params_object(rho=NON_NEGATIVE, rho_by_epsilon=by_epsilon(NON_NEGATIVE))

    @classmethod
    def default_params(cls) -> dict[str, Any]:
        return {"rho": 0.03, "rho_by_epsilon": None}

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        # Both are aligned with all_params(); None where a parameter was not trained. The set
        # of trained parameters may change between logical batches (the UT strategy).
        self._direction: list[torch.Tensor | None] | None = None  # privatized, post-processed
        self._backup: list[torch.Tensor | None] | None = None  # unperturbed weights

    # --- ascent phase ------------------------------------------------------------------------
    def before_gradient(self, model: nn.Module, loss_fn, first: bool) -> None:
        if not first or self._direction is None or self._backup is not None:
            return
        assert self.optimizer is not None
        rho = float(self.param_at_epsilon("rho"))
        pairs = [
            (i, p, d)
            for i, (p, d) in enumerate(
                zip(all_params(self.optimizer), self._direction, strict=True)
            )
            if p.requires_grad and d is not None
        ]
        if rho == 0 or not pairs:
            return
        norm = float(global_norm([d for _, _, d in pairs]))
        if not math.isfinite(norm) or norm == 0:
            return
        self._backup = [None] * len(self._direction)
        with torch.no_grad():
            for i, p, d in pairs:
                self._backup[i] = p.detach().clone()
                p.add_(d, alpha=rho / norm)

    def after_release(self, opt: DPOptimizer) -> None:
        params = all_params(opt)
        with torch.no_grad():
            if self._backup is not None:
                for p, w in zip(params, self._backup, strict=True):
                    if w is not None:
                        p.copy_(w)
                self._backup = None
            released = [p.grad.detach() if p.requires_grad else None for p in params]
            self._update_direction(released)

    def _update_direction(self, released: list[torch.Tensor | None]) -> None:
        self._direction = [None if g is None else g.clone() for g in released]

    # --- state -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "direction": self._direction,
            "backup": self._backup,
        }

    def restore(self, state: dict[str, Any], place: Place) -> None:
        self._direction = place.all(state["direction"])
        self._backup = place.all(state["backup"])


@register_algorithm("dpsat-momentum")
class DPSATMomentum(DPSAT):
    """DP-SAT ascending along m_t = beta * m_{t-1} + g~_t (Appendix G.1, Eq. 13-15).

    m_t is a function of released gradients only (post-processing). `beta` None takes the base
    optimizer's momentum, as the paper does; the paper tunes rho about 10x larger than DP-SAT's.
    """

    params_schema = params_object(
        rho=NON_NEGATIVE, rho_by_epsilon=by_epsilon(NON_NEGATIVE), beta=nullable(FRACTION)
    )

    @classmethod
    def default_params(cls) -> dict[str, Any]:
        return {"rho": 0.3, "rho_by_epsilon": None, "beta": None}

    def _beta(self) -> float:
        if self.params["beta"] is not None:
            return float(self.params["beta"])
        assert self.optimizer is not None
        return float(self.optimizer.param_groups[0].get("momentum", 0.0))

    def _update_direction(self, released: list[torch.Tensor | None]) -> None:
        if self._direction is None:
            super()._update_direction(released)
            return
        beta = self._beta()
        for i, g in enumerate(released):
            m = self._direction[i]
            if g is None:
                continue  # not trained this step: its momentum is kept as it is
            if m is None:
                self._direction[i] = g.clone()
            else:
                m.mul_(beta).add_(g)
