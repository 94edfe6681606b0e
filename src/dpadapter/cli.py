"""Entry points the Snakemake rules call: `python -m dpadapter <stage> ...`.

Every stage validates the config first, so bad input fails before any work starts.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from dpadapter.config import ConfigError, load
from dpadapter.federated.cli import add_parsers as add_federated_parsers
from dpadapter.hpo.cli import add_parsers as add_hpo_parsers


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="dpadapter")
    ap.add_argument("--config", required=True, type=Path)
    sub = ap.add_subparsers(dest="stage", required=True)
    sub.add_parser("validate")
    w = sub.add_parser("warmup")
    w.add_argument("--out", required=True, type=Path)
    p = sub.add_parser("pretrain")
    p.add_argument("--method", required=True)
    p.add_argument("--warmup", type=Path)
    p.add_argument("--out", required=True, type=Path)
    f = sub.add_parser("finetune")
    for k in ("upstream", "task", "algo"):
        f.add_argument(f"--{k}", required=True)
    f.add_argument("--eps", required=True, type=float)
    f.add_argument("--seed", required=True, type=int)
    f.add_argument("--ckpt", required=True, type=Path)
    f.add_argument("--out", required=True, type=Path)
    a = sub.add_parser("aggregate")
    a.add_argument("--metrics", nargs="+", required=True, type=Path)
    a.add_argument("--pretrain", nargs="*", default=[], type=Path)
    a.add_argument("--csv", required=True, type=Path)
    a.add_argument("--md", required=True, type=Path)
    fg = sub.add_parser("figures", help="figures of the main run")
    fg.add_argument("--finetune-csv", required=True, type=Path)
    fg.add_argument("--pretrain", nargs="+", required=True, type=Path)
    fg.add_argument("--out", required=True, type=Path)
    sw = sub.add_parser("sweep-figures", help="figures of the gamma sweeps")
    sw.add_argument("--pretrain", nargs="+", required=True, type=Path)
    sw.add_argument("--finetune", nargs="+", required=True, type=Path)
    sw.add_argument("--out", required=True, type=Path)
    add_hpo_parsers(sub.add_parser("hpo", help="private HPO with the linear scaling rule"))
    add_federated_parsers(sub.add_parser("federated", help="DP federated learning (Pretrain-DPFL)"))
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")

    try:
        cfg = load(args.config)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.stage == "validate":
        print("config OK")
        return 0
    if args.stage == "warmup":
        from dpadapter.stages import warmup

        warmup.run(cfg, args.out)
    elif args.stage == "pretrain":
        from dpadapter.stages import pretrain

        pretrain.run(cfg, args.method, args.out, args.warmup)
    elif args.stage == "finetune":
        from dpadapter.stages import finetune

        m = finetune.run(
            cfg, args.upstream, args.task, args.algo, args.eps, args.seed, args.ckpt, args.out
        )
        print(f"test accuracy {m['test_accuracy']:.4f}  epsilon {m['privacy']['epsilon']:.3f}")
    elif args.stage == "aggregate":
        from dpadapter.stages import aggregate

        aggregate.run(args.metrics, args.pretrain, list(cfg.upstreams), args.csv, args.md)
    elif args.stage == "figures":
        from dpadapter.stages import figures

        figures.main_figures(args.finetune_csv, args.pretrain, list(cfg.upstreams), args.out)
    elif args.stage == "sweep-figures":
        from dpadapter.stages import figures

        figures.sweep_figures(args.pretrain, args.finetune, args.out)
    elif args.stage == "hpo":
        from dpadapter.hpo.cli import run as run_hpo

        run_hpo(cfg, args)
    elif args.stage == "federated":
        from dpadapter.federated.cli import run as run_federated

        run_federated(cfg, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
