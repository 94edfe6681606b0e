"""The privacy checks are not tautologies: each fails on an algorithm broken the way real code is.

The mutants are not registered (so the parametrized suite does not see them).
"""

from __future__ import annotations

from typing import ClassVar

import privacy_checks as C
import pytest
import torch
from opacus.optimizers import AdaClipDPOptimizer

from dpadapter.algorithms.adpclip import (
    AdpClip,
    CentredAdaClipOptimizer,
    gradient_noise_multiplier,
)
from dpadapter.algorithms.base import Release
from dpadapter.algorithms.dpsat import DPSAT
from dpadapter.algorithms.dpsgd import DPSGD


class OverclaimingLedger(DPSGD):
    """Records twice the noise it adds."""

    name: ClassVar[str] = "mutant-overclaim"

    def accounted_noise_multiplier(self, opt) -> float:
        return 2 * opt.noise_multiplier


class Opacus154AdpClip(AdpClip):
    """Records the inflated gradient multiplier, as Opacus <= 1.5.4 exposed it."""

    name: ClassVar[str] = "mutant-adaclip-inflated"

    def accounted_noise_multiplier(self, opt) -> float:
        return gradient_noise_multiplier(opt.noise_multiplier, opt.unclipped_num_std)


class UncentredCountOptimizer(CentredAdaClipOptimizer):
    def add_noise(self) -> None:
        super().add_noise()
        self.count_signal += self.sample_size / 2  # the count Opacus actually noises


class UncentredAdpClip(AdpClip):
    """Releases sum_i b_i (sensitivity 1) while claiming the centred count's 1/2."""

    name: ClassVar[str] = "mutant-adaclip-uncentred"
    optimizer_class = UncentredCountOptimizer


class PerPhysicalBatchCount(CentredAdaClipOptimizer):
    def zero_grad(self, set_to_none: bool = False) -> None:
        AdaClipDPOptimizer.zero_grad(self, set_to_none)  # Opacus: reset at every physical batch
        self.unclipped_num = torch.zeros(())


class ResettingAdpClip(AdpClip):
    name: ClassVar[str] = "mutant-adaclip-reset"
    optimizer_class = PerPhysicalBatchCount


class LooseClip(DPSGD):
    """Declares a tenth of the clip bound it applies."""

    name: ClassVar[str] = "mutant-loose-clip"

    def describe_release(self, opt) -> list[Release]:
        r = super().describe_release(opt)[0]
        return [Release(r.name, r.sensitivity / 10, r.noise_std, r.signal, r.noise)]


class UnderNoised(DPSGD):
    """Adds 0.9x the noise it declares."""

    name: ClassVar[str] = "mutant-under-noised"

    def describe_release(self, opt) -> list[Release]:
        r = super().describe_release(opt)[0]
        return [Release(r.name, r.sensitivity / 0.9, r.noise_std / 0.9, r.signal, r.noise)]


class LeavesPerturbation(DPSAT):
    """DP-SAT that never removes its ascent (what the public code does with virtual batches)."""

    name: ClassVar[str] = "mutant-dpsat-leak"

    def after_release(self, opt) -> None:
        self._backup = None
        self._update_direction([p.grad.detach() for p in opt.params])


class PerturbsPerPhysicalBatch(DPSAT):
    """DP-SAT that ascends before every physical batch and restores at the end."""

    name: ClassVar[str] = "mutant-dpsat-per-physical"

    def before_gradient(self, model, loss_fn, first: bool) -> None:
        super().before_gradient(model, loss_fn, True)
        if self._backup is not None and not first:
            with torch.no_grad():
                norm = float(torch.sqrt(sum((d * d).sum() for d in self._direction)))
                for p, d in zip(self.optimizer.params, self._direction, strict=True):
                    p.add_(d, alpha=float(self.params["rho"]) / norm)


@pytest.mark.parametrize("mutant", [OverclaimingLedger, Opacus154AdpClip])
def test_noise_check_catches_a_ledger_that_records_more_noise_than_added(mutant, algo_data):
    with pytest.raises(AssertionError, match="only have joint multiplier"):
        C.check_noise(mutant, algo_data, steps=20)


def test_noise_check_catches_under_noise(algo_data):
    with pytest.raises(AssertionError, match=r"noise std is 0\.(89|90)"):
        C.check_noise(UnderNoised, algo_data, steps=20)


@pytest.mark.parametrize("mutant", [LooseClip, UncentredAdpClip])
def test_sensitivity_check_catches_contributions_beyond_the_bound(mutant, algo_data):
    with pytest.raises(AssertionError, match="one example contributes"):
        C.check_sensitivity(mutant, algo_data)


def test_weight_check_catches_a_perturbation_left_in_the_weights(algo_data):
    with pytest.raises(AssertionError, match="weights drift"):
        C.check_restores_weights(LeavesPerturbation, algo_data)


@pytest.mark.parametrize("mutant", [ResettingAdpClip, PerturbsPerPhysicalBatch])
def test_virtual_batch_check_catches_per_physical_batch_state(mutant, algo_data):
    with pytest.raises(AssertionError, match="physical batches of"):
        C.check_virtual_batches(mutant, algo_data)
