"""DP-SAM (Park et al. 2023, Section 4.1, Eq. 8-9): SAM with both gradients privatized.

Accounting choice. Both gradients are computed on the same Poisson batch, so a step is one
subsampled mechanism answering two Gaussian queries, the second chosen after seeing the first.
Adaptive composition of two Gaussians with multiplier s each is exactly a Gaussian with
multiplier s / sqrt(2), and Poisson subsampling of that joint mechanism is what the ledger
records: one (s / sqrt(2), q, 1) segment per step. This is not the same as two independent
subsampled releases (s, q, 2): those would be amplified by two independent batch draws, which
the algorithm does not make, and they under-report epsilon (tests/algorithms compares the two).
Theorem 4.1's epsilon_1 + epsilon_2 is also valid but looser.

At equal target epsilon the run keeps DP-SGD's number of steps and calibrates the joint
multiplier to the target, so each gradient carries sqrt(2) times DP-SGD's noise multiplier. The
paper instead keeps sigma and cuts the steps; with a fixed epoch budget per run, more noise at
the same schedule is the comparison this pipeline makes.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from dpadapter.algorithms.base import DPAlgorithm, global_norm, param_copies, register_algorithm
from dpadapter.ground.device import Place
from dpadapter.ground.param_schema import NON_NEGATIVE, by_epsilon, params_object


@register_algorithm("dpsam")
class DPSAM(DPAlgorithm):
    """Privatized ascent gradient at w, privatized descent gradient at w + rho * g~/||g~||.

    With virtual batches the ascent needs the whole logical batch before the descent can start:
    each physical batch's clipped ascent sum is accumulated as it arrives (and its physical
    inputs kept), and the last physical batch releases the ascent, perturbs, replays the kept
    batches at the perturbed weights and releases the descent; the weights are restored (by copy)
    before the base optimizer's update. Both releases use Opacus' clip, noise and scale phases.
    """

    releases_per_step: ClassVar[int] = 2
    mechanism_note: ClassVar[str | None] = (
        "DP-SAM answers two adaptive Gaussian queries (ascent and descent gradient, each with "
        "clip C and noise multiplier sqrt(2)*sigma) on the same Poisson batch per step; the "
        "ledger records each step as one Poisson-subsampled Gaussian with multiplier sigma, the "
        "exact joint multiplier of the two queries."
    )

    params_schema = params_object(rho=NON_NEGATIVE, rho_by_epsilon=by_epsilon(NON_NEGATIVE))

    @classmethod
    def default_params(cls) -> dict[str, Any]:
        return {"rho": 0.05, "rho_by_epsilon": None}

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._ascent_sum: list[torch.Tensor] | None = None
        self._kept: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._backup: list[torch.Tensor] | None = None

    def _clear_grads(self) -> None:
        assert self.optimizer is not None
        for p in self.optimizer.params:
            p.grad_sample = None
            p.grad = None

    def train_step(
        self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn
    ) -> torch.Tensor | float:
        opt = self.optimizer
        assert opt is not None
        opt.zero_grad(set_to_none=True)
        last = self._ends_logical_batch()
        loss: torch.Tensor | float = 0.0
        if len(y):
            loss = self._gradient(model, x, y, loss_fn).detach()
            self._kept.append((x, y))
        else:
            self._set_empty_grad_samples()
        opt.clip_and_accumulate()
        sums = [p.summed_grad for p in opt.params]
        if self._ascent_sum is None:
            self._ascent_sum = sums
        else:
            for acc, s in zip(self._ascent_sum, sums, strict=True):
                acc.add_(s)
        for p in opt.params:
            p.summed_grad = None
        self._clear_grads()
        if not last:
            opt._check_skip_next_step()  # consume this physical batch's skip flag
            return loss

        # ascent release: Opacus' noise and scale on the accumulated clipped sum
        self._set_empty_grad_samples()  # scale_grad reads accumulated_iterations from these
        for p, s in zip(opt.params, self._ascent_sum, strict=True):
            p.summed_grad = s
        opt.add_noise()
        opt.scale_grad()
        self._pending_releases.append(self._gradient_release("ascent", opt, opt.noise_multiplier))
        direction = [p.grad.detach() for p in opt.params]
        norm = float(global_norm(direction))
        rho = float(self.param_at_epsilon("rho"))
        backup = param_copies(opt)
        if rho != 0 and norm > 0:
            with torch.no_grad():
                for p, d in zip(opt.params, direction, strict=True):
                    p.add_(d, alpha=rho / norm)
        for p in opt.params:
            p.summed_grad = None
        self._clear_grads()
        self._ascent_sum = None

        # descent release at the perturbed weights, over the same physical batches
        kept, self._kept = self._kept, []
        self._backup = backup
        if not kept:
            self._set_empty_grad_samples()
        for i, (xk, yk) in enumerate(kept):
            self._gradient(model, xk, yk, loss_fn)
            if i < len(kept) - 1:
                opt.clip_and_accumulate()
                self._clear_grads()
        opt.step()  # clip the last batch, noise, ledger hook (restores the weights), update
        return loss

    def after_release(self, opt) -> None:
        if self._backup is None:
            return
        with torch.no_grad():
            for p, w in zip(opt.params, self._backup, strict=True):
                p.copy_(w)
        self._backup = None

    def state_dict(self) -> dict[str, Any]:
        # Between logical batches both are empty; inside one they hold the ascent in progress.
        return {**super().state_dict(), "ascent_sum": self._ascent_sum, "kept": self._kept}

    def restore(self, state: dict[str, Any], place: Place) -> None:
        self._ascent_sum = place.all(state["ascent_sum"])
        # the kept inputs replay through the model, so they follow its device and dtype too
        # (integer labels keep theirs)
        self._kept = [(place(x), place(y)) for x, y in state["kept"]]
