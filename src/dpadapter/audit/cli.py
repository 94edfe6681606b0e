"""`python -m dpadapter --config C audit {run,summary} ...` (argparse here, lazy imports)."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parsers(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="audit_action", required=True)
    r = sub.add_parser("run", help="one audited training run (algorithm x epsilon)")
    r.add_argument("--algo", required=True)
    r.add_argument("--eps", required=True, type=float)
    r.add_argument("--out", required=True, type=Path)
    s = sub.add_parser("summary", help="audit.csv, audit.md and the figure")
    s.add_argument("--records", nargs="+", required=True, type=Path)
    s.add_argument("--csv", required=True, type=Path)
    s.add_argument("--md", required=True, type=Path)
    s.add_argument("--fig", required=True, type=Path)


def run(cfg, args: argparse.Namespace) -> None:
    from dpadapter.audit import stage

    if args.audit_action == "run":
        r = stage.run(cfg, args.algo, args.eps, args.out)
        print(
            f"{r['algorithm']} eps {r['claimed_epsilon']:.3f}: eps_lb {r['epsilon_lb']:.3f} "
            f"({r['correct']}/{r['guesses']} correct)"
        )
    else:
        stage.summary(args.records, args.csv, args.md, args.fig)
        print(args.md.read_text())
