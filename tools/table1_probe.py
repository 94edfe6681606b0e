"""Measurements behind docs/validity.md's reading of AdpClip's and GEP's Table 1 cells.

Run on the public proxy task (`tasks.fmnist-proxy`: public data held out of pre-training, the
task the recipes are chosen on), so it costs no privacy and reads no private split:

- AdpClip's clip course: the clip C_t after each epoch (a post-processed release) and the
  validation accuracy, with clip_lr as configured and with clip_lr = 0 (the clip fixed at C_0:
  DP-SGD with AdpClip's slightly larger gradient noise), so a low cell can be told to come from
  the adaptive clip or from the rest of the algorithm;
- GEP at each epsilon: per seed, so an epsilon-4 cell below its epsilon-1 cell can be told to be
  seed noise or a property of GEP at this size.

    PYTHONPATH=src python tools/table1_probe.py --config config.yaml --upstreams standard scratch

It prints a markdown table per probe (one worker; about 25 fine-tuning runs).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from dpadapter.hpo.recipe import Run, proxy_run
from dpadapter.settings import RECIPE_KEYS, load


def _pm(values: list[float]) -> str:
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{100 * statistics.fmean(values):.1f} ± {100 * sd:.1f}"


def adpclip_course(cfg, task, recipe, upstreams, seeds, eps) -> list[str]:
    lines = [
        f"AdpClip on {task} at ε = {eps:g} (recipe {recipe}): validation accuracy (%) and the "
        "clip C_t after epochs 1, 2, 4 and the last (median over seeds)",
        "",
        "| upstream | clip_lr | val acc per seed | mean ± sd | C_1 | C_2 | C_4 | C_last |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for up in upstreams:
        for clip_lr in (0.2, 0.0):
            accs, clips = [], []
            for seed in seeds:
                course: list[float] = []
                run = Run(up, recipe, eps, seed, "adpclip", {"clip_lr": clip_lr})
                out = proxy_run(cfg, task, run, lambda e, s, c=course: c.append(s["clip"]))
                accs.append(out["val_accuracy"])
                clips.append(course)
            med = [statistics.median(c[i] for c in clips) for i in (0, 1, 3, -1)]
            per_seed = " / ".join(f"{100 * a:.1f}" for a in accs)
            lines.append(
                f"| {up} | {clip_lr:g} | {per_seed} | {_pm(accs)} | "
                + " | ".join(f"{c:.3g}" for c in med)
                + " |"
            )
    return lines


def by_epsilon(cfg, task, recipe, upstreams, seeds, algos, epsilons) -> list[str]:
    lines = [
        f"Validation accuracy (%) on {task} per seed, by ε (recipe {recipe})",
        "",
        "| algorithm | upstream | " + " | ".join(f"ε={e:g}" for e in epsilons) + " |",
        "|---|---|" + "---|" * len(epsilons),
    ]
    for algo in algos:
        for up in upstreams:
            cells = []
            for eps in epsilons:
                accs = [
                    proxy_run(cfg, task, Run(up, recipe, eps, s, algo))["val_accuracy"]
                    for s in seeds
                ]
                cells.append(" / ".join(f"{100 * a:.1f}" for a in accs) + f" ({_pm(accs)})")
            lines.append(f"| {algo} | {up} | " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", type=Path, default=Path("config.yaml"))
    p.add_argument("--task", default="fmnist-proxy")
    p.add_argument("--upstreams", nargs="+", default=["standard", "scratch"])
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--skip", nargs="*", default=[], choices=["adpclip", "gep"])
    a = p.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    cfg = load(a.config)
    recipe = {k: getattr(cfg.finetune, k) for k in RECIPE_KEYS}  # DP-SGD's, the grid's shared
    if "adpclip" not in a.skip:
        print("\n".join(adpclip_course(cfg, a.task, recipe, a.upstreams, a.seeds, 1.0)), "\n")
    if "gep" not in a.skip:
        lines = by_epsilon(cfg, a.task, recipe, a.upstreams, a.seeds, ["gep"], [1.0, 4.0])
        print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
