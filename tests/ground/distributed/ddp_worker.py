"""Run by torchrun (tests/ground/distributed): one case of a multi-process DP job, results to files.

Each rank writes `<out>/rank<r>.pt`; the tests compare them with a one-process run made in the
test's own process by the same functions (`release` and `fit` with no process group).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset

from dpadapter.algorithms import DPRunSpec
from dpadapter.ground import distributed
from dpadapter.models import create_model
from dpadapter.per_sample import wrap_for_dp
from dpadapter.per_sample.optimizers import dp_optimizer
from dpadapter.settings import ModelConfig
from dpadapter.train.dp_fit import FitSettings, dp_fit
from dpadapter.train.resume import ResumeFile

CLASSES = 3


def data(n: int = 48, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, 12, 12, generator=g)
    return TensorDataset(x, torch.randint(0, CLASSES, (n,), generator=g))


def model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return create_model(ModelConfig(name="cnn-gn", groups=2, width=4), CLASSES, 1, seed, None)


def release(mode: str, sigma: float, rows: torch.Tensor, expected: int, dtype=torch.float64):
    """One release of the DP optimizer on `rows` of `data()`: each process clips its share of
    the rows, the optimizer sums over the processes (and adds noise once). Returns the released
    vector (p.grad, scaled back up by the expected batch size)."""
    x, y = data().tensors
    m = model().to(dtype)
    wrapped = wrap_for_dp(m, mode, False, (x.shape[1:], dtype), check=False)
    base = torch.optim.SGD(wrapped.parameters(), lr=0.0)
    gen = torch.Generator().manual_seed(1234)
    opt = dp_optimizer(
        __import__("opacus").optimizers.DPOptimizer, wrapped, base,
        noise_multiplier=sigma, max_grad_norm=0.5, expected_batch_size=expected, generator=gen,
    )  # fmt: skip
    opt.zero_grad(set_to_none=True)
    if len(rows):
        out = wrapped(x[rows].to(dtype))
        nn.functional.cross_entropy(out, y[rows]).backward()
    else:  # an empty local batch still joins the release
        for p in opt.params:
            p.grad_sample = torch.zeros((0, *p.shape), dtype=p.dtype)
    opt.step()
    return torch.cat([p.grad.reshape(-1) * expected for p in opt.params]).detach()


def spec(n: int, epochs: int = 2, eps: float = 4.0) -> DPRunSpec:
    q = 0.125
    return DPRunSpec(
        target_epsilon=eps, delta=1e-5, sample_rate=q, steps_per_epoch=int(1 / q),
        epochs=epochs, expected_batch_size=int(q * n), max_grad_norm=1.0, accountant="rdp",
    )  # fmt: skip


def settings(mode: str = "bk") -> FitSettings:
    return FitSettings(
        lr=0.2, momentum=0.5, grad_sample_mode=mode, physical_batch_size=None,
        pad_batches=False, device="cpu", tf32=False, per_sample_check=False,
    )  # fmt: skip


def fit(algo: str, mode: str = "bk", n: int = 48, resume: Path | None = None, stop_after=None):
    m = model()
    train = data(n)

    def on_epoch(epoch, stats):
        if stop_after is not None and epoch > stop_after:
            raise KeyboardInterrupt("killed")  # after the state of epoch `stop_after` was saved

    rf = ResumeFile(resume, identity="ddp-test") if resume is not None else None
    _, ledger = dp_fit(m, train, algo, spec(n), settings(mode), 0, on_epoch=on_epoch, resume=rf)
    weights = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
    return {"weights": weights, "epsilon": ledger.epsilon(), "history": ledger.state_dict()}


MODES = ("bk", "hooks", "ew", "functorch")
SIGMAS = (0.0, 1.3)
TOTAL = 10  # rows of one release, split over the ranks


def releases(w: distributed.World) -> dict:
    """Every mode at noise 0 and 1.3 on rows 0..9 split over the ranks; rows 0..4 on rank 0
    only (rank 1's local batch empty), and on rank 1 only at noise 1.3 (rank 0's empty)."""
    out = {}
    for mode in MODES:
        for sigma in SIGMAS:
            rows = torch.arange(TOTAL)[w.rank :: w.size]
            out[(mode, sigma)] = release(mode, sigma, rows, TOTAL)
    out["empty"] = release("bk", 0.0, torch.arange(5) if w.rank == 0 else torch.arange(0), 5)
    # rank 0 (the one that draws the noise) with an empty local batch, noise on: its draw
    # must still reach every rank, once
    out["empty-rank0-noisy"] = release(
        "bk", 1.3, torch.arange(0) if w.rank == 0 else torch.arange(5), 5
    )
    return out


def planted(w: distributed.World) -> dict:
    """The noisy releases again under each planted bug (`plant`), then the code put back."""
    from dpadapter.per_sample import optimizers

    honest, out = optimizers.DistributedNoise.add_noise, {}
    for bug in BUGS:
        plant(bug)
        try:
            out[bug] = {
                "bk": release("bk", 1.3, torch.arange(TOTAL)[w.rank :: w.size], TOTAL),
                "empty-rank0-noisy": release(
                    "bk", 1.3, torch.arange(0) if w.rank == 0 else torch.arange(5), 5
                ),
            }
        finally:
            optimizers.DistributedNoise.add_noise = honest
    return out


BUGS = ("every-rank", "none")


def plant(bug: str) -> None:
    """The bugs the noise test must catch: every rank adds its own noise, or none does."""
    from dpadapter.per_sample import optimizers

    def every_rank(self):
        super(optimizers.DistributedNoise, self).add_noise()
        distributed.all_reduce_sum([p.grad for p in self.params])

    def none(self):
        for p in self.params:
            p.grad = p.summed_grad.clone().view_as(p)
        distributed.all_reduce_sum([p.grad for p in self.params])

    optimizers.DistributedNoise.add_noise = {"every-rank": every_rank, "none": none}[bug]


UPSTREAM_PARAMS = {
    "sam": {"epochs": 1, "max_steps": 6, "m": 16, "gamma": 0.5, "lr": 0.05, "milestones": []},
    "dpadapter": {
        "epochs": 1, "max_steps": 6, "m1": 40, "m2": 16, "gamma": 0.5, "lr": 0.05,
        "milestones": [], "chunk_size": 7,
    },
}  # fmt: skip


def pretrain(method: str) -> dict:
    """Non-private training as the warm-up (`standard`: sgd_train's standard step) and the
    upstream methods run it, on a public set of 48: the updates a one-process run makes."""
    from dpadapter.settings import SGDConfig
    from dpadapter.train.loops import sgd_train
    from dpadapter.upstream import UPSTREAMS

    m, public = model(), data(48, seed=3)
    if method == "standard":
        sgd_train(m, public, SGDConfig(epochs=2, batch_size=12, lr=0.05, momentum=0.9), seed=0)
    else:
        up = UPSTREAMS[method](UPSTREAM_PARAMS[method])
        sgd_train(m, public, up.sgd_config(), seed=0, step=up.make_step(public, 0))
    return {"weights": torch.cat([p.detach().reshape(-1) for p in m.parameters()])}


PRETRAIN = ("standard", "sam", "dpadapter")


def refusals(algos) -> dict:
    """Each algorithm's refusal to run in several processes (None: it ran)."""
    result = {}
    for a in algos:
        try:
            fit(a, "bk", 24)
            result[a] = None
        except ValueError as exc:
            result[a] = str(exc)
    return result


def resumed(algo: str, path: Path) -> dict:
    """Stopped after epoch 1's state was saved (as a killed job is), then resumed from it."""
    try:
        fit(algo, "bk", 48, resume=path, stop_after=1)
    except KeyboardInterrupt:
        pass
    return fit(algo, "bk", 48, resume=path)


def main() -> None:
    case, out = sys.argv[1], Path(sys.argv[2])
    w = distributed.init(torch.device("cpu"))
    args = sys.argv[3:]
    if case == "all":
        # Every case that ends normally, in one launch: starting torchrun and two workers (each
        # importing torch, Opacus and the package) costs ~12 s of CPU, the cases a second each.
        # Each case seeds its own model, data and generators, so the order changes nothing.
        result = {
            "releases": releases(w),
            "fit": {a: fit(a, "bk", 24) for a in args},
            "refuse": refusals(("gep", "adpclip")),
            "straight": fit("dpsgd", "bk", 48),
            "resume": resumed("dpsgd", out / "state.pt"),
            "pretrain": {name: pretrain(name) for name in PRETRAIN},
            "planted": planted(w),  # last: nothing runs after a planted bug, undone or not
        }
    elif case == "releases":
        result = releases(w)
    elif case == "fit":
        result = {a: fit(a, args[0], int(args[1])) for a in args[2:]}
    elif case == "refuse":
        result = refusals(args)
    elif case == "pretrain":
        result = {name: pretrain(name) for name in args}
    elif case == "resume":
        result = resumed(args[0], out / "state.pt")
    elif case == "crash":
        if w.rank == 1:
            raise RuntimeError("planted crash on rank 1")
        result = fit("dpsgd", "bk", 48)
    else:
        raise SystemExit(f"unknown case {case}")
    result["world"] = (w.rank, w.size)
    torch.save(result, out / f"rank{w.rank}.pt")
    distributed.shutdown()


if __name__ == "__main__":
    main()
