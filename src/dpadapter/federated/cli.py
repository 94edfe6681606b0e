"""`python -m dpadapter --config C federated {run,summary} ...` (argparse here, lazy imports)."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parsers(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="federated_action", required=True)
    r = sub.add_parser("run", help="one DP federated fine-tuning job")
    for k in ("upstream", "strategy", "mechanism"):
        r.add_argument(f"--{k}", required=True)
    r.add_argument("--eps", required=True, type=float)
    r.add_argument("--rounds", required=True, type=int)
    r.add_argument("--seed", required=True, type=int)
    r.add_argument("--ckpt", required=True, type=Path)
    r.add_argument("--out", required=True, type=Path)
    s = sub.add_parser("summary", help="federated.csv, the T1 rule's hit rate and the figures")
    s.add_argument("--metrics", nargs="+", required=True, type=Path)
    s.add_argument("--csv", required=True, type=Path)
    s.add_argument("--rule", required=True, type=Path)
    s.add_argument("--fig-eps", required=True, type=Path)
    s.add_argument("--fig-rounds", required=True, type=Path)
    s.add_argument("--md", required=True, type=Path)


def run(cfg, args: argparse.Namespace) -> None:
    if args.federated_action == "run":
        from dpadapter.federated import stage

        m = stage.run(
            cfg,
            args.upstream,
            args.strategy,
            args.mechanism,
            args.eps,
            args.rounds,
            args.seed,
            args.ckpt,
            args.out,
        )
        print(
            f"test accuracy {m['test_accuracy']:.4f}  "
            f"max client epsilon {m['privacy']['epsilon']:.3f}"
        )
    else:
        from dpadapter.federated import summary

        summary.run(cfg, args.metrics, args.csv, args.rule, args.fig_eps, args.fig_rounds, args.md)
