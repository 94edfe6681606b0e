"""A ViT's bk step with its tokens trained by the closed form, by the old torch.func replay, and
frozen, side by side in one process (issue 36: the replay cost a second pass of the model).

Each variant is one DP step of book-keeping clipping (forward, backward, norms, clipped sum,
noise 0) on the same batch; steps are timed round-robin (one of each variant per round) so a
change in machine load hits all alike, and the median over rounds is reported with the ratio to
the frozen-token step. Before timing, the closed form's clipped sum is checked against the
replay's (relative error, float32).

    .venv/bin/python bench/cpu/vit_tokens_bk.py [--batch 32] [--steps 7] [--depth 4] [--device cpu]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import timm
import torch
from opacus.optimizers import DPOptimizer

import dpadapter  # noqa: F401  (torchvision shim)
from dpadapter.per_sample import bookkeeping
from dpadapter.per_sample.bookkeeping import BookKeepingModule
from dpadapter.per_sample.optimizers import dp_optimizer

TOKENS = ("cls_token", "pos_embed")


class Variant:
    def __init__(self, name: str, base: torch.nn.Module, batch: int):
        self.name = name
        model = copy.deepcopy(base)
        if name == "frozen tokens":
            for t in TOKENS:
                getattr(model, t).requires_grad_(False)
        real = bookkeeping.token_layout
        if name == "torch.func replay":  # the path before the closed form
            bookkeeping.token_layout = lambda m: None
        try:
            self.bk = BookKeepingModule(model)
        finally:
            bookkeeping.token_layout = real
        params = [p for p in self.bk.parameters() if p.requires_grad]
        self.opt = dp_optimizer(
            DPOptimizer,
            self.bk,
            torch.optim.SGD(params, lr=0.0), noise_multiplier=0.0, max_grad_norm=1.0,
            expected_batch_size=batch,
        )  # fmt: skip

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(self.bk(x), y).backward()
        self.opt.clip_and_accumulate()

    def summed(self) -> torch.Tensor:
        return torch.cat([p.summed_grad.reshape(-1) for p in self.opt.params])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    torch.manual_seed(0)
    base = timm.create_model(
        "vit_tiny_patch16_224", img_size=32, patch_size=4, depth=args.depth, num_classes=10
    ).to(dev)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.batch, 3, 32, 32, generator=g).to(dev)
    y = torch.randint(0, 10, (args.batch,), generator=g).to(dev)
    names = ("closed form", "torch.func replay", "frozen tokens")
    runs = {n: Variant(n, base, args.batch) for n in names}
    for v in runs.values():
        v.step(x, y)
    plans = {n: v.bk.last_plan.get("<root>", "(no root record)") for n, v in runs.items()}
    a, b = runs["closed form"].summed(), runs["torch.func replay"].summed()
    check = float((a - b).norm() / b.norm())
    times: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(args.steps):
        for n, v in runs.items():
            v.opt.zero_grad(set_to_none=True)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            v.step(x, y)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            times[n].append(time.perf_counter() - t)
    ref = statistics.median(times["frozen tokens"])
    out = {
        "model": f"vit_tiny_patch16_224 32x32 patch 4 depth {args.depth}",
        "batch": args.batch,
        "device": str(dev),
        "threads": torch.get_num_threads(),
        "root_plan": plans,
        "closed_form_vs_replay_rel_error": check,
        "median_s": {n: round(statistics.median(t), 4) for n, t in times.items()},
        "ratio_to_frozen": {n: round(statistics.median(t) / ref, 3) for n, t in times.items()},
    }
    print(json.dumps(out, indent=2))
    return 0 if check < 1e-4 else 1


if __name__ == "__main__":
    raise SystemExit(main())
