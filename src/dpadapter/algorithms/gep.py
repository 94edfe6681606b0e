"""GEP: gradient embedding perturbation (Yu et al. 2021).

Each parameter group's per-example gradients are split into an embedding in a low-dimensional
anchor subspace, estimated from PUBLIC gradients only, and the residual outside it; both parts
are clipped and noised separately, then recombined. The subspace is a function of public data
and of earlier releases (the current weights), so it costs no privacy.

Accounting: the embedding and residual sums are two Gaussian queries on the same Poisson batch
(sensitivities C_e and C_r, noise s*C_e and s*C_r). Together they are one Gaussian query on the
concatenated, sensitivity-normalised vector with multiplier s / sqrt(2), and the ledger records
that joint release once per step. Counting them as two independent subsampled releases (s, q, 2),
as the public GEP code does with twice the RDP, assumes two independent batch draws and
under-reports epsilon (tests/algorithms shows by how much).

Public data: the stage must call `set_public_data(dataset)` (any dataset of (x, y) pairs; the
pipeline's public training split) before `make_optimizer`; `needs_public_data` says so.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
from opacus.optimizers import DPOptimizer
from opacus.optimizers.optimizer import _check_processed_flag, _mark_as_processed
from torch import nn

from dpadapter.algorithms.base import DPAlgorithm, Release, register_algorithm
from dpadapter.ground.device import Place
from dpadapter.ground.param_schema import (
    NON_NEGATIVE_INT,
    POSITIVE,
    POSITIVE_INT,
    nullable,
    params_object,
)
from dpadapter.per_sample.clip import clip_factors
from dpadapter.privacy.randomness import gaussian_noise


def split_groups(sizes: list[int], num_groups: int) -> list[list[int]]:
    """Consecutive parameters into at most `num_groups` groups of about equal size."""
    total, groups, current, filled = sum(sizes), [], [], 0
    for i, n in enumerate(sizes):
        current.append(i)
        filled += n
        remaining = num_groups - len(groups) - 1
        if remaining > 0 and filled >= total * (len(groups) + 1) / num_groups:
            groups.append(current)
            current = []
    if current:
        groups.append(current)
    return groups


def power_method(
    anchors: torch.Tensor, num_bases: int, iters: int, generator: torch.Generator
) -> torch.Tensor:
    """Orthonormal rows (k x d) spanning the top right-singular subspace of `anchors` (m x d).

    Subspace (block power) iteration on A^T A from a Gaussian start drawn from `generator`; the
    GEP paper uses a few power iterations instead of an exact SVD to keep the cost O(mdk).
    """
    m, d = anchors.shape
    k = max(1, min(num_bases, m, d))
    v = torch.randn(d, k, generator=generator, dtype=anchors.dtype, device=generator.device)
    v = v.to(anchors.device)
    for _ in range(iters):
        v = anchors.T @ (anchors @ v)
        v, _ = torch.linalg.qr(v)
    if iters == 0:
        v, _ = torch.linalg.qr(v)
    return v.T.contiguous()


class GEPOptimizer(DPOptimizer):
    """Opacus' DPOptimizer with GEP's clip and noise phases; skip/scale/hook stay Opacus'.

    Residual sums live in `p.summed_grad` (so Opacus' virtual-step bookkeeping applies as is),
    embedding sums per group in `embedding_sum`. Residual norms are computed from explicit
    residuals rather than as ||g||^2 - ||e||^2, whose cancellation could understate them and
    let a clipped residual exceed its bound.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        noise_multiplier: float,
        embedding_clip: float,
        residual_clip: float,
        num_groups: int,
        expected_batch_size: int,
        generator: torch.Generator,
    ):
        super().__init__(
            optimizer,
            noise_multiplier=noise_multiplier,
            max_grad_norm=math.hypot(embedding_clip, residual_clip),
            expected_batch_size=expected_batch_size,
            loss_reduction="mean",
            generator=generator,
        )
        self.embedding_clip = embedding_clip
        self.residual_clip = residual_clip
        self.num_groups = num_groups
        self.groups: list[list[int]] = []
        self.offsets: list[list[int]] = []
        self._layout: tuple[int, ...] | None = None
        self.bases: list[torch.Tensor] | None = None
        self.embedding_sum: list[torch.Tensor] | None = None
        self.keep_audit = False
        self.audit_parts: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.ensure_layout()

    def ensure_layout(self) -> bool:
        """Group the trained parameters; True if the grouping changed (bases then refit).

        Opacus' `params` are those with requires_grad, a set the UT strategy changes between
        logical batches. Bases are kept only if their shapes still fit the groups (a resumed run
        restores bases saved under the same grouping).
        """
        layout = tuple(id(p) for p in self.params)
        if layout == self._layout:
            return False
        self._layout = layout
        self.groups = split_groups([p.numel() for p in self.params], self.num_groups)
        self.offsets = []
        for g in self.groups:
            offs, o = [], 0
            for i in g:
                offs.append(o)
                o += self.params[i].numel()
            self.offsets.append(offs)
        self.set_bases(self.bases)
        return True

    def group_sizes(self) -> list[int]:
        return [sum(self.params[i].numel() for i in g) for g in self.groups]

    def set_bases(self, bases: list[torch.Tensor] | None) -> None:
        fits = bases is not None and [v.shape[1] for v in bases] == self.group_sizes()
        self.bases = bases if fits else None

    def _blocks(self, g: int):
        assert self.bases is not None
        v = self.bases[g]
        for i, off in zip(self.groups[g], self.offsets[g], strict=True):
            p = self.params[i]
            yield i, p, v[:, off : off + p.numel()]

    def zero_grad(self, set_to_none: bool = False) -> None:
        if not self._is_last_step_skipped:
            self.embedding_sum = None
        super().zero_grad(set_to_none)

    def clip_and_accumulate(self) -> None:
        if self.bases is None:
            raise RuntimeError("gep: no anchor subspace; before_gradient computes it")
        samples = self.grad_samples
        n = len(samples[0])
        ref = self.params[0]
        sq_emb = torch.zeros(n, device=ref.device, dtype=ref.dtype)
        sq_res = torch.zeros_like(sq_emb)
        embeddings = []
        for g in range(len(self.groups)):
            e = torch.zeros(n, self.bases[g].shape[0], device=ref.device, dtype=ref.dtype)
            for i, p, vb in self._blocks(g):
                e += samples[i].reshape(n, p.numel()).to(p.dtype) @ vb.T
            for i, p, vb in self._blocks(g):
                r = samples[i].reshape(n, p.numel()).to(p.dtype) - e @ vb
                sq_res += (r * r).sum(dim=1)
            sq_emb += (e * e).sum(dim=1)
            embeddings.append(e)
        f_emb = clip_factors(sq_emb.sqrt(), self.embedding_clip)
        f_res = clip_factors(sq_res.sqrt(), self.residual_clip)
        if self.embedding_sum is None:
            self.embedding_sum = [e.new_zeros(e.shape[1]) for e in embeddings]
        for g, e in enumerate(embeddings):
            self.embedding_sum[g] += f_emb @ e
            projected = f_res @ e  # sum_i f_i e_i, removed below: sum_i f_i (g_i - e_i V)
            for i, p, vb in self._blocks(g):
                _check_processed_flag(p.grad_sample)
                res = torch.einsum("i,i...", f_res, samples[i].to(p.dtype))
                res -= (projected @ vb).view_as(p)
                if p.summed_grad is not None:
                    p.summed_grad += res
                else:
                    p.summed_grad = res
                _mark_as_processed(p.grad_sample)

    def add_noise(self) -> None:
        assert self.embedding_sum is not None and self.bases is not None
        s = self.noise_multiplier
        noisy_emb, emb_noise, res_noise = [], [], []
        for e in self.embedding_sum:
            z = gaussian_noise(s * self.embedding_clip, e, self.generator, self.secure_mode)
            noisy_emb.append(e + z)
            emb_noise.append(z)
        for g in range(len(self.groups)):
            for _i, p, vb in self._blocks(g):
                _check_processed_flag(p.summed_grad)
                z = gaussian_noise(
                    s * self.residual_clip, p.summed_grad, self.generator, self.secure_mode
                )
                p.grad = (p.summed_grad + z + (noisy_emb[g] @ vb).view_as(p)).view_as(p)
                res_noise.append(z.reshape(-1))
                _mark_as_processed(p.summed_grad)
        if self.keep_audit:
            res_signal = [
                self.params[i].summed_grad.reshape(-1)
                for g in range(len(self.groups))
                for i in self.groups[g]
            ]
            self.audit_parts = {
                "embedding": (torch.cat(self.embedding_sum).clone(), torch.cat(emb_noise)),
                "residual": (torch.cat(res_signal).clone(), torch.cat(res_noise)),
            }


@register_algorithm("gep")
class GEP(DPAlgorithm):
    """Anchor subspace from public per-example gradients, refreshed every `anchor_every` steps.

    Parameters are split into `num_groups` consecutive groups of about equal size, each with
    its own `num_bases`-dimensional subspace (the paper's memory trick). The anchor gradients
    are those of `public_batch_size` public examples drawn (with the run's generator) at the
    start of a logical batch, at the current weights. `public_labels`: "predicted" uses the
    model's own argmax labels, which works when the public label space differs from the task's
    (the DPAdapter setting: the public classes are not the task's); "given" uses the public
    labels, which must index the task head. `embedding_clip` None is finetune.max_grad_norm,
    `residual_clip` None is half of it (residuals are the smaller part; GEP uses 5 and 2).
    """

    releases_per_step: ClassVar[int] = 2
    needs_public_data: ClassVar[bool] = True
    needs_per_sample_gradients: ClassVar[bool] = True  # it projects them onto its anchors
    distributed_refusal: ClassVar[str | None] = (
        "GEP's anchor subspace and its two noised parts are drawn from the noise generator and "
        "computed per process; summing them across processes is not implemented"
    )
    mechanism_note: ClassVar[str | None] = (
        "GEP releases a clipped gradient embedding (clip C_e, noise sqrt(2)*sigma*C_e) and "
        "residual (clip C_r, noise sqrt(2)*sigma*C_r) computed on the same Poisson batch; the "
        "ledger records each step as one Poisson-subsampled Gaussian with multiplier sigma, the "
        "joint multiplier of the concatenated normalised release. The anchor subspace comes "
        "from public data and the current weights only."
    )

    params_schema = params_object(
        num_bases=POSITIVE_INT,
        num_groups=POSITIVE_INT,
        power_iters=NON_NEGATIVE_INT,
        public_batch_size=POSITIVE_INT,
        anchor_every=POSITIVE_INT,
        public_labels={"enum": ["predicted", "given"]},
        embedding_clip=nullable(POSITIVE),
        residual_clip=nullable(POSITIVE),
    )

    @classmethod
    def default_params(cls) -> dict[str, Any]:
        return {
            "num_bases": 16,
            "num_groups": 3,
            "power_iters": 1,
            "public_batch_size": 100,
            "anchor_every": 1,
            "public_labels": "predicted",
            "embedding_clip": None,
            "residual_clip": None,
        }

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        labels = self.params["public_labels"]
        if labels not in ("predicted", "given"):
            raise ValueError(f"gep: public_labels must be 'predicted' or 'given', got {labels!r}")
        for key in ("num_bases", "num_groups", "public_batch_size", "anchor_every"):
            if int(self.params[key]) < 1:
                raise ValueError(f"gep: {key} must be >= 1, got {self.params[key]}")
        self._public: tuple[torch.Tensor, torch.Tensor] | None = None
        self._batches = 0  # logical batches begun, for anchor_every
        self._bases: list[torch.Tensor] | None = None

    @property
    def embedding_clip(self) -> float:
        c = self.params["embedding_clip"]
        return float(c) if c is not None else self.spec.max_grad_norm

    @property
    def residual_clip(self) -> float:
        c = self.params["residual_clip"]
        return float(c) if c is not None else self.spec.max_grad_norm / 2

    def set_public_data(self, dataset: torch.utils.data.Dataset) -> None:
        tensors = getattr(dataset, "tensors", None)
        if tensors is not None:
            x, y = tensors[0], tensors[1]
        else:
            pairs = [dataset[i] for i in range(len(dataset))]
            x = torch.stack([torch.as_tensor(a) for a, _ in pairs])
            y = torch.as_tensor([int(b) for _, b in pairs])
        if len(x) == 0:
            raise ValueError("gep: the public dataset is empty")
        self._public = (x, y)

    def make_optimizer(self, optimizer: torch.optim.Optimizer, wrapped: nn.Module) -> DPOptimizer:
        if self._public is None:
            raise RuntimeError(
                "gep needs public data: call algo.set_public_data(public.train) before "
                "make_optimizer (see dpadapter.algorithms.gep)"
            )
        opt = self._new_optimizer(
            GEPOptimizer,
            wrapped,
            optimizer,
            noise_multiplier=self.release_noise_multiplier(self.noise_multiplier(0)),
            embedding_clip=self.embedding_clip,
            residual_clip=self.residual_clip,
            num_groups=int(self.params["num_groups"]),
            expected_batch_size=self.spec.expected_batch_size,
            generator=self.generator,
        )
        opt.set_bases(self._bases)
        return self._attach(opt)

    # --- ascent-phase slot: refresh the anchor subspace -------------------------------------
    def before_gradient(self, model: nn.Module, loss_fn, first: bool) -> None:
        assert self.optimizer is not None
        self.optimizer.keep_audit = self.audit is not None
        if not first:
            return
        self.optimizer.ensure_layout()
        due = self._batches % int(self.params["anchor_every"]) == 0
        self._batches += 1
        if due or self.optimizer.bases is None:
            self._refresh_anchor(model, loss_fn)

    def _refresh_anchor(self, model: nn.Module, loss_fn) -> None:
        opt = self.optimizer
        assert opt is not None and self._public is not None
        x_all, y_all = self._public
        m = min(int(self.params["public_batch_size"]), len(x_all))
        idx = torch.randperm(len(x_all), generator=self.generator, device=self.generator.device)
        idx = idx[:m].to(x_all.device)
        device = opt.params[0].device
        x = x_all[idx].to(device)
        if self.params["public_labels"] == "predicted":
            with torch.no_grad():
                y = model(x).argmax(dim=1)
        else:
            y = y_all[idx].to(device)
        loss_fn(model(x), y).backward()
        samples = [p.grad_sample.reshape(m, -1) for p in opt.params]
        for p in opt.params:
            p.grad_sample = None
            p.grad = None
        bases = []
        for g in opt.groups:
            anchors = torch.cat([samples[i] for i in g], dim=1).detach()
            bases.append(
                power_method(
                    anchors,
                    int(self.params["num_bases"]),
                    int(self.params["power_iters"]),
                    self.generator,
                )
            )
        self._bases = bases
        opt.set_bases(bases)

    def describe_release(self, opt: DPOptimizer) -> list[Release]:
        assert isinstance(opt, GEPOptimizer)
        s = opt.noise_multiplier
        out = []
        for name, clip in (("embedding", opt.embedding_clip), ("residual", opt.residual_clip)):
            if self.audit is not None:
                signal, noise = opt.audit_parts[name]
                out.append(Release(name, clip, s * clip, signal, noise))
            else:
                out.append(Release(name, clip, s * clip))
        return out

    def state_dict(self) -> dict[str, Any]:
        bases = self.optimizer.bases if self.optimizer is not None else self._bases
        return {**super().state_dict(), "bases": bases, "batches": self._batches}

    def restore(self, state: dict[str, Any], place: Place) -> None:
        self._bases = place.all(state["bases"])
        self._batches = int(state["batches"])
        if self.optimizer is not None:
            self.optimizer.set_bases(self._bases)

    def describe(self) -> dict[str, Any]:
        return {
            **super().describe(),
            "embedding_clip": self.embedding_clip,
            "residual_clip": self.residual_clip,
        }
