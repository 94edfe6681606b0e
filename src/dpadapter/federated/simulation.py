"""FedSGD / FedAvg with client-side DP, simulated in one process (Pretrain-DPFL Algorithm 1).

Each round t every client starts from the global model, runs `local_steps` DP steps on its own
data (Poisson-sampled Gaussian or full-batch Laplace, see `mechanisms`) on the parameters the
strategy trains in that round's phase (head only in HT, all in FT, biases and head in BiTFiT),
and the server sets the
global parameters to the d_i/d-weighted mean of the clients' results. With one local step and
plain SGD this is FedSGD: theta - lr * sum_i (d_i/d) g~_i. More local steps give FedAvg.

Privacy: one ledger per client for the whole run (never reset per round), fed by the step hook
of that client's Opacus optimizer, so it holds exactly the releases the client made. Sample-level
DP: each example belongs to one client, and its guarantee is its client's epsilon (the global
model is post-processing of all releases; the clients' data are disjoint, so the overall
guarantee w.r.t. one example is the maximum of the clients' epsilons).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from opacus.optimizers import DPOptimizer
from torch import nn
from torch.utils.data import TensorDataset

from dpadapter.federated.mechanisms import GAUSSIAN, LAPLACE, LaplaceDPOptimizer, make_ledger
from dpadapter.privacy import randomness
from dpadapter.train.batching import masked_cross_entropy, pad_batch, padded_size
from dpadapter.train.strategies import Schedule, apply_phase


@dataclass(frozen=True)
class MechanismRun:
    """What a client's optimizer needs: mechanism, clip C, noise (per C, on the sum), rate q."""

    name: str
    max_grad_norm: float
    noise_multiplier: float
    sample_rate: float
    lr: float
    delta: float = 0.0
    accountant: str = "prv"
    randomness: str = "seeded"  # privacy.randomness: the clients' noise and masks from the OS

    def __post_init__(self) -> None:
        if self.name == LAPLACE and self.sample_rate != 1.0:
            raise ValueError("the Laplace mechanism (Theorem 1) uses every example each round")

    @property
    def accounted_multiplier(self) -> float:
        """What the ledger records per release: Gaussian sigma, or Laplace scale / l1-sensitivity
        (the clipped sum's replace-one sensitivity is 2C)."""
        return self.noise_multiplier if self.name == GAUSSIAN else self.noise_multiplier / 2.0


class Client:
    """One client's data, RNGs (sampling and noise: seeded, or secret), ledger and optimizers.

    `pad`: pad every Poisson sample to one size (`pad_to`) with masked rows, as fine-tuning
    does on CUDA (dpadapter.train.batching): with cuDNN benchmark on, each new batch shape
    would be autotuned again. Padded rows have zero per-example gradient, so the clipped sum
    and the update are those of the unpadded sample; a sample larger than `pad_to` (a few in
    100,000) keeps its own shape. Full-batch clients (Laplace) have one shape already.
    """

    def __init__(
        self,
        index: int,
        data: TensorDataset,
        mech: MechanismRun,
        seed: int,
        device: torch.device | None = None,
        pad: bool = False,
    ):
        self.index = index
        self.data = data
        self.mech = mech
        self.size = len(data)
        q = mech.sample_rate
        self.pad_to = padded_size(q * self.size, q) if pad and q < 1.0 else None
        # The mechanism's noise is drawn on the model's device (Opacus needs the generator there).
        if mech.randomness == randomness.SECRET:
            self.sample_gen = randomness.secret_generator()
            self.noise_gen = randomness.secret_generator(device or "cpu")
        else:
            self.sample_gen = torch.Generator().manual_seed(1_000_003 * (seed + 1) + 2 * index)
            self.noise_gen = torch.Generator(device=device or "cpu").manual_seed(
                1_000_003 * (seed + 1) + 2 * index + 1
            )
        self.ledger = make_ledger(mech.name, mech.delta, mech.accountant)
        self._optimizers: dict[str, DPOptimizer] = {}
        self.audit: list[dict] | None = None

    def sample(self) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.data.tensors
        if self.mech.sample_rate >= 1.0:
            return x, y
        mask = randomness.poisson_mask(self.size, self.mech.sample_rate, self.sample_gen)
        mask = mask.to(x.device)
        return x[mask], y[mask]

    def optimizer(self, phase: str, params: list[nn.Parameter]) -> DPOptimizer:
        """The client's DP optimizer for `phase`, built once over that phase's parameters."""
        if phase not in self._optimizers:
            m = self.mech
            cls = DPOptimizer if m.name == GAUSSIAN else LaplaceDPOptimizer
            opt = cls(
                torch.optim.SGD(params, lr=m.lr),
                noise_multiplier=m.noise_multiplier,
                max_grad_norm=m.max_grad_norm,
                expected_batch_size=m.sample_rate * self.size,
                loss_reduction="mean",
                generator=self.noise_gen,
            )
            opt.attach_step_hook(lambda o, phase=phase: self._on_release(o, phase))
            self._optimizers[phase] = opt
        return self._optimizers[phase]

    def _on_release(self, opt: DPOptimizer, phase: str) -> None:
        self.ledger.record(self.mech.accounted_multiplier, self.mech.sample_rate, 1)
        if self.audit is not None:
            scale = opt.expected_batch_size * opt.accumulated_iterations
            noise = torch.cat([(p.grad * scale - p.summed_grad).reshape(-1) for p in opt.params])
            self.audit.append(
                {"phase": phase, "dim": int(noise.numel()), "noise": noise.detach().clone()}
            )


class Federation:
    """Global model + clients; `run` trains for `schedule.total` rounds."""

    def __init__(
        self,
        gsm: nn.Module,
        clients: list[Client],
        schedule: Schedule,
        local_steps: int = 1,
    ):
        self.gsm = gsm
        self.clients = clients
        self.schedule = schedule
        self.local_steps = local_steps
        self.total = sum(c.size for c in clients)
        self.trace: list[dict] = []

    def round(self, t: int) -> dict:
        phase = self.schedule.phase(t)
        params = apply_phase(self.gsm, phase)
        start = [p.detach().clone() for p in params]
        new = [torch.zeros_like(p) for p in params]
        loss_sum, n_seen = 0.0, 0
        for client in self.clients:
            with torch.no_grad():
                for p, s in zip(params, start, strict=True):
                    p.copy_(s)
            opt = client.optimizer(phase, params)
            for _ in range(self.local_steps):
                loss_sum, n_seen = self._local_step(client, opt, loss_sum, n_seen)
            w = client.size / self.total
            with torch.no_grad():
                for acc, p in zip(new, params, strict=True):
                    acc.add_(p, alpha=w)
        with torch.no_grad():
            for p, v in zip(params, new, strict=True):
                p.copy_(v)
        rec = {
            "round": t + 1,
            "phase": phase,
            "released_dim": sum(p.numel() for p in params),
            "train_loss": loss_sum / max(1, n_seen),
        }
        self.trace.append(rec)
        return rec

    def _local_step(self, client: Client, opt: DPOptimizer, loss_sum: float, n_seen: int):
        opt.zero_grad(set_to_none=True)
        x, y = client.sample()
        if len(y) == 0:  # an empty Poisson sample still releases (noise only), as accounted
            for p in opt.params:
                p.grad_sample = torch.zeros((0, *p.shape), dtype=p.dtype, device=p.device)
        elif client.pad_to is not None:
            n = len(y)
            x, y = pad_batch(x, y, client.pad_to, opt)
            loss = masked_cross_entropy(self.gsm(x), y)  # padded rows: zero loss and gradient
            loss.backward()
            loss_sum += float(loss.detach()) * len(y)  # the mean is over the padded size
            n_seen += n
        else:
            loss = nn.functional.cross_entropy(self.gsm(x), y)
            loss.backward()
            loss_sum += float(loss.detach()) * len(y)
            n_seen += len(y)
        opt.step()
        return loss_sum, n_seen

    def run(self, on_round: Callable[[dict], None] | None = None) -> list[dict]:
        for t in range(self.schedule.total):
            rec = self.round(t)
            if on_round is not None:
                on_round(rec)
        return self.trace
