"""bk's clipped sum against ew's and torch.func's, on every model the shipped configs use.

Why: `bk` is the default `finetune.grad_sample_mode`; the claim it rests on is that it releases
what Opacus' `ew` (the old default) releases. This checks it on each architecture a shipped
config trains, not on a test model: `config.yaml` and every `configs/*.yaml` are loaded, and
their `model` (name, groups, width) and their `pretrain.external` backbones (with their
`timm_args` and input adapter) are collected; the federated stage and HPO network trials train
the same models. Beside them: the HPO probe's bias-free linear head and the federated audit's
linear model. A hub / torchvision backbone is built with random weights (nothing is
downloaded); by default at depth 2 (`--full` keeps the real depth: slow on a CPU), which keeps
every module type the real network has.

For each model and each strategy that changes what is trained (ft: every parameter, ht: the
head, bitfit: biases and head), one float64 batch goes through the pipeline's wrap
(`wrap_for_dp`) and DP optimizer (`dp_optimizer`, noise 0) in each mode, and `p.summed_grad`
is compared with a reference: per-example gradients of the trained parameters by torch.func
(vmap of grad over the whole model), each clipped by `min(1, C / (|g_i| + 1e-6))`, summed. C
is the median per-example norm, so half the examples are clipped. A mode that Opacus cannot run
on a model (ew on a ViT's root parameters) is reported as such; bk must pass on every row.

    .venv/bin/python bench/cpu/bk_equivalence.py [--full] [--batch 4] [--tol 1e-9] [--only NAME]
"""

from __future__ import annotations

import argparse
import copy
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from opacus.optimizers import DPOptimizer
from torch import nn
from torch.func import functional_call, grad, vmap

import dpadapter  # noqa: F401  (torchvision compatibility shim before any model import)
from dpadapter.models import create_model
from dpadapter.models.batchnorm import apply_batchnorm_choice, freeze_batchnorm
from dpadapter.models.input_adapter import adapt
from dpadapter.per_sample import dp_optimizer, wrap_for_dp
from dpadapter.settings import ModelConfig, load
from dpadapter.train.strategies import apply_phase

warnings.filterwarnings("ignore", message="Full backward hook is firing")
warnings.filterwarnings("ignore", message="Using a non-full backward hook")

REPO = Path(__file__).resolve().parents[2]
MODES = ("bk", "ew")
PHASES = ("ft", "ht", "bitfit")
CLASSES = 5
SHALLOW = 2  # blocks kept of a timm backbone's `blocks` (same module types); `--full`: all


@dataclass
class Case:
    """One architecture to check: how to build it and its input."""

    label: str
    build: object  # () -> nn.Module, seeded
    shape: tuple[int, ...]
    configs: list[str] = field(default_factory=list)
    phases: tuple[str, ...] = PHASES  # () : every parameter (a model without a head)


def shipped_configs() -> list[Path]:
    return [REPO / "config.yaml", *sorted((REPO / "configs").glob("*.yaml"))]


def _input_shape(cfg) -> tuple[int, int, int]:
    from dpadapter.data import DATASET_INFO

    task = next(iter(cfg.tasks.values()))
    info = DATASET_INFO.get(task.dataset)
    chans = getattr(task, "channels", None) or (info.channels if info else None) or 1
    side = 28 if "mnist" in task.dataset and chans == 1 else 32
    return (chans, side, side)


def collect(full: bool = False) -> list[Case]:
    """Every distinct model of the shipped configs, with the configs that use it."""
    cases: dict[str, Case] = {}

    def add(key: str, case: Case, where: str) -> None:
        cases.setdefault(key, case).configs.append(where)

    for path in shipped_configs():
        cfg = load(path)
        where = path.relative_to(REPO).as_posix()
        shape = _input_shape(cfg)
        m = cfg.model
        if not m.name.startswith("timm:"):
            label = f"{m.name} (groups {m.groups}, width {m.width})"
            add(label, Case(label, _pipeline(m, shape[0]), shape), where)
        for ext in cfg.external_upstreams.values():
            name = ext["model"]
            if not name.startswith("timm:"):
                label = f"{name} (groups {m.groups}, width {m.width})"
                add(label, Case(label, _pipeline(m, shape[0], name), shape), where)
                continue
            depth = "random weights" if full else f"first {SHALLOW} blocks, random weights"
            label = f"{name.split('.')[0]} ({depth})"
            add(label, _external_case(label, ext, m, shape, full), where)
    # the probe trains only its bias-free head; the audit's linear model trains all it has
    probe = Case("HPO probe head (linear, no bias)", _probe_head, (64,), phases=("all",))
    audit = Case("federated audit (linear)", _audit_linear, (24,), phases=("all",))
    return [*cases.values(), probe, audit]


def _probe_head() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(64, CLASSES, bias=False)


def _audit_linear() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(24, 10)


def _pipeline(m: ModelConfig, in_chans: int, name: str | None = None):
    mc = ModelConfig(name or m.name, m.groups, m.width, m.batchnorm)
    return lambda: create_model(mc, CLASSES, in_chans, seed=0)


def _external_case(label: str, ext: dict, m: ModelConfig, shape, full: bool) -> Case:
    from dpadapter.upstream.external import External

    spec = External(ext).adapter_spec(shape[0])
    chans = (spec.channels if spec else None) or shape[0]
    mc = ModelConfig(ext["model"], m.groups, m.width, "freeze")
    choice = ext.get("batchnorm") or m.batchnorm

    def build() -> nn.Module:
        backbone = create_model(mc, CLASSES, chans, seed=0, timm_args=ext.get("timm_args", {}))
        if not full and isinstance(getattr(backbone, "blocks", None), nn.Sequential):
            backbone.blocks = backbone.blocks[:SHALLOW]
        return adapt(apply_batchnorm_choice(backbone, choice), spec)

    return Case(label, build, shape)


def _trained(model: nn.Module, phase: str) -> list[nn.Parameter]:
    if phase == "all":
        return [p.requires_grad_(True) for p in model.parameters()]
    return apply_phase(model, phase)


def reference(model: nn.Module, x, y, c: float | None):
    """torch.func per-example gradients of the trained parameters, clipped and summed."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    params = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    rest = {n: p.detach() for n, p in model.named_parameters() if not p.requires_grad}
    buffers = dict(model.named_buffers())

    def loss(ps, xi, yi):
        out = functional_call(model, {**ps, **rest, **buffers}, (xi.unsqueeze(0),))
        return nn.functional.cross_entropy(out, yi.unsqueeze(0))

    g = vmap(grad(loss), in_dims=(None, 0, 0), randomness="error")(params, x, y)
    flat = torch.cat([g[n].reshape(len(y), -1) for n in names], dim=1)
    norms = flat.norm(dim=1)
    if c is None:
        c = float(norms.median())
    factor = (c / (norms + 1e-6)).clamp(max=1.0)
    return (flat * factor[:, None]).sum(0), c


def clipped_sum(model: nn.Module, mode: str, x, y, c: float) -> torch.Tensor:
    """The pipeline's clipped sum in `mode` (noise 0, lr 0: nothing moves)."""
    gsm = wrap_for_dp(model, mode)
    gsm.train()
    opt = dp_optimizer(
        DPOptimizer,
        gsm,
        torch.optim.SGD([p for p in gsm.parameters() if p.requires_grad], lr=0.0),
        noise_multiplier=0.0,
        max_grad_norm=c,
        expected_batch_size=len(y),
        loss_reduction="mean",
    )
    nn.functional.cross_entropy(gsm(x), y).backward()
    opt.step()
    out = torch.cat([p.summed_grad.reshape(-1) for p in opt.params])
    opt.zero_grad(set_to_none=True)
    if hasattr(gsm, "_close"):
        gsm._close()
    return out


def check_case(case: Case, phase: str, batch: int, modes=MODES) -> dict:
    base = case.build().double()
    freeze_batchnorm(base, "train")  # as dp_fit and the federated stage do
    base.train()
    trained = _trained(base, phase)
    if not trained:
        return {}
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, *case.shape, generator=g, dtype=torch.float64)
    with torch.no_grad():
        classes = base(x[:1]).shape[-1]
    y = torch.randint(0, classes, (batch,), generator=g)
    ref, c = reference(base, x, y, None)
    row = {
        "model": case.label,
        "phase": phase,
        "params": sum(p.numel() for p in trained),
        "clip": c,
        "ref_norm": float(ref.norm()),
    }
    got = {}
    for mode in modes:
        try:
            got[mode] = clipped_sum(copy.deepcopy(base), mode, x, y, c)
        except Exception as e:  # noqa: BLE001  (reported: Opacus cannot run every model)
            row[mode] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:70]}"}
            continue
        d = got[mode] - ref
        row[mode] = {"max_abs": float(d.abs().max()), "rel": float(d.norm() / ref.norm())}
    if "bk" in got and "ew" in got:
        d = got["bk"] - got["ew"]
        row["bk_vs_ew"] = {"max_abs": float(d.abs().max()), "rel": float(d.norm() / ref.norm())}
    return row


def passed(row: dict, tol: float) -> bool:
    bk = row.get("bk", {})
    ok = "rel" in bk and bk["rel"] < tol
    other = row.get("bk_vs_ew")
    return (
        ok
        and (other is None or other["rel"] < tol)
        and all(v["rel"] < tol for k, v in row.items() if k in MODES and "rel" in v)
    )


def table(rows: list[dict], tol: float) -> str:
    def cell(v: dict | None) -> str:
        if v is None:
            return "-"
        if "error" in v:
            return f"n/a ({v['error']})"
        return f"{v['max_abs']:.1e} / {v['rel']:.1e}"

    lines = [
        "| model | strategy | trained params | bk vs torch.func (max abs / rel) "
        "| ew vs torch.func | bk vs ew | pass |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['phase']} | {r['params']:,} | {cell(r.get('bk'))} "
            f"| {cell(r.get('ew'))} | {cell(r.get('bk_vs_ew'))} "
            f"| {'yes' if passed(r, tol) else 'NO'} |"
        )
    note = "float64; relative: L2 of the difference / L2 of the reference; tolerance"
    return "\n".join(lines) + f"\n\n{note} {tol:g}\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--full", action="store_true", help="timm backbones at their real depth")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--tol", type=float, default=1e-9)
    ap.add_argument("--only", help="models whose label contains this")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    cases = collect(args.full)
    if args.only:
        cases = [c for c in cases if args.only in c.label]
    rows = []
    for case in cases:
        print(f"{case.label}: used by {', '.join(case.configs) or 'the HPO / audit'}", flush=True)
        for phase in case.phases:
            row = check_case(case, phase, args.batch)
            if row:
                rows.append(row)
    print()
    print(table(rows, args.tol))
    failed = [(r["model"], r["phase"]) for r in rows if not passed(r, args.tol)]
    if failed:
        print(f"bk equivalence FAILED for {failed}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
