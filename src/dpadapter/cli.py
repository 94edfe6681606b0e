"""Entry points the Snakemake rules call: `python -m dpadapter <stage> ...`.

Every stage validates the config first, so bad input fails before any work starts.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from dpadapter.config import ConfigError, load


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
    return 0


if __name__ == "__main__":
    sys.exit(main())
