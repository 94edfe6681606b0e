"""`sam`: the paper's "vanilla SAM" baseline (AMP with one ascent step).

The baseline DPAdapter is compared with: Delta comes from the same mini-batch that is then used
for the update, as in every SAM variant the paper compares with. Keeping everything else equal
to DPAdapter (the step of `upstream.perturbed`, its schedule and eta1, which the paper does not
give for SAM) makes the batch choice the only difference between the two.

One step on a batch of m examples (`PerturbedStep` with no B1 sampler):

1. ascent step on the batch itself: Delta = eta1 * grad L_batch(theta);
2. if ||Delta||_2 > gamma, rescale Delta onto the gamma ball;
3. the update gradient: grad L_batch at theta + Delta (the same batch);
4. revert to theta exactly, then the SGD step with that gradient.

Parameters besides the shared schedule (`upstream.perturbed`):

==============  =====================================================  ==========
parameter       meaning                                                paper
==============  =====================================================  ==========
m               shared batch size (perturbation and update)            100
gamma           radius of the L2 ball on Delta                         1.0
==============  =====================================================  ==========
"""

from __future__ import annotations

from typing import Any

from torch.utils.data import TensorDataset

from dpadapter.ground.param_schema import NON_NEGATIVE, POSITIVE_INT, params_object
from dpadapter.upstream.base import register_upstream
from dpadapter.upstream.perturbed import (
    SCHEDULE_DEFAULTS,
    SCHEDULE_SCHEMA,
    PerturbedStep,
    PerturbedUpstream,
)


@register_upstream("sam")
class SAM(PerturbedUpstream):
    """Vanilla SAM / AMP baseline: Delta and the update come from the same batch of size m."""

    params_schema = params_object(**SCHEDULE_SCHEMA, m=POSITIVE_INT, gamma=NON_NEGATIVE)

    @classmethod
    def default_params(cls) -> dict[str, Any]:
        # No refresh_every: reusing Delta would take it from an earlier batch, which is no longer
        # the same-batch baseline this method stands for.
        return {**SCHEDULE_DEFAULTS, "m": 100, "gamma": 1.0}

    def update_batch_size(self) -> int:
        return int(self.params["m"])

    def make_step(self, data: TensorDataset, seed: int) -> PerturbedStep:
        p = self.params
        # No sampler: the perturbation is computed on the update batch (steps 1-2), then the
        # same batch gives the update (steps 3-4).
        return PerturbedStep(data, p["eta1"], p["gamma"], p["chunk_size"])
