"""Entry points the Snakemake rules call: `python -m dpadapter <stage> ...`.

Every stage validates the config first, so bad input fails before any work starts.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

from dpadapter.audit.cli import add_parsers as add_audit_parsers
from dpadapter.federated.cli import add_parsers as add_federated_parsers
from dpadapter.hpo.cli import add_parsers as add_hpo_parsers
from dpadapter.settings import read_raw, split_folder
from dpadapter.validation.compose import ConfigError, validate_files
from dpadapter.validation.optional_sections import stage_sections


def _written_since(folder: Path, t0: float) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.stat().st_mtime >= t0 - 1)


def _print_written(paths: list[Path]) -> None:
    """Summary jobs say what they wrote, so their logs are not empty (Slurm users read them)."""
    for p in paths:
        print(f"wrote {p} ({Path(p).stat().st_size} bytes)", file=sys.stderr)


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
    a.add_argument("--paired-json", type=Path, help="the paired differences' numbers")
    fg = sub.add_parser("figures", help="figures of the main run")
    fg.add_argument("--finetune-csv", required=True, type=Path)
    fg.add_argument("--pretrain", nargs="+", required=True, type=Path)
    fg.add_argument("--out", required=True, type=Path)
    rf = sub.add_parser("reference", help="a published table beside ours (config `reference`)")
    rf.add_argument("--finetune-csv", required=True, type=Path)
    rf.add_argument("--csv", required=True, type=Path)
    rf.add_argument("--md", required=True, type=Path)
    so = sub.add_parser(
        "table-so-far", help="the tables from the fine-tuning runs finished so far (runs nothing)"
    )
    so.add_argument("--out", type=Path, default=None, help="default: <results_dir>/summary/so-far")
    sw = sub.add_parser("sweep-figures", help="figures of the gamma sweeps")
    sw.add_argument("--pretrain", nargs="+", required=True, type=Path)
    sw.add_argument("--finetune", nargs="+", required=True, type=Path)
    sw.add_argument("--out", required=True, type=Path)
    add_hpo_parsers(sub.add_parser("hpo", help="private HPO with the linear scaling rule"))
    add_federated_parsers(sub.add_parser("federated", help="DP federated learning (Pretrain-DPFL)"))
    add_audit_parsers(sub.add_parser("audit", help="empirical privacy audit (one-run canaries)"))
    va = sub.add_parser("validity", help="results/summary/validity.md: each claim, tested")
    for k in ("hpo", "federated-rule", "finetune", "gpu-summary", "paired"):
        va.add_argument(f"--{k}", type=Path, default=None)
    va.add_argument("--out", required=True, type=Path)
    rp = sub.add_parser("report-page", help="one summary table as an HTML page of the report")
    rp.add_argument("--kind", required=True, choices=["markdown", "upstream", "speed"])
    rp.add_argument("--inputs", nargs="+", required=True, type=Path)
    rp.add_argument("--pretrain", nargs="*", default=[], type=Path)
    rp.add_argument("--title", required=True)
    rp.add_argument("--section", required=True)
    rp.add_argument("--config-names", required=True)
    rp.add_argument("--out", required=True, type=Path)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")

    # The workflow checked every backbone before any job; a pretrain job builds its method's
    # from the config, a fine-tuning job its upstream's from the checkpoint's own record.
    own = {"pretrain": [getattr(args, "method", "")], "finetune": []}.get(args.stage)
    # Likewise every grid cell's epsilon against the calibration's reach: a job checks the one
    # it trains (`validate` all of them).
    cells = None if args.stage == "validate" else []
    if args.stage == "finetune":
        cells = [(args.task, args.eps)]
    # an optional section a stage does not read never stops it
    # (dpadapter.validation.optional_sections)
    try:
        raw = read_raw(args.config)
        cfg = validate_files(
            raw,
            [args.config],
            sections=stage_sections(args.stage, raw),
            backbones=own,
            cells=cells,
        )
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.stage == "validate":
        print("config OK")
        return 0
    processes = 1
    if _trains_privately(args):
        processes = cfg.finetune.processes
    elif args.stage in ("warmup", "pretrain"):
        processes = cfg.pretrain_processes
    if processes > 1 and "WORLD_SIZE" not in os.environ:
        # the job again as `processes` processes under torchrun (dpadapter.ground.distributed),
        # which fails the whole job when one of them fails
        from dpadapter.ground.distributed import run_torchrun

        return run_torchrun(processes, list(sys.argv[1:] if argv is None else argv))
    from dpadapter.tracking import TrackingError

    try:
        if "WORLD_SIZE" in os.environ:
            from dpadapter.ground import device, distributed

            distributed.init(device.resolve(cfg.device))
        _dispatch(args, cfg)
    except TrackingError as exc:  # tracking.enabled: true and MLflow unusable: one clear line
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        if "WORLD_SIZE" in os.environ:
            from dpadapter.ground import distributed

            distributed.shutdown()
    return 0


# The commands that train one DP model through `dp_fit` (`finetune.processes` applies to them):
# fine-tuning and the HPO's network trials, final runs and baselines.
HPO_TRAINING_STEPS = ("trial", "final", "random-search", "grid-run")


def _trains_privately(args: argparse.Namespace) -> bool:
    if args.stage == "finetune":
        return True
    return args.stage == "hpo" and getattr(args, "hpo_step", None) in HPO_TRAINING_STEPS


def _dispatch(args: argparse.Namespace, cfg) -> None:
    """Run the stage the command line names (its modules are imported only when needed)."""
    if args.stage == "warmup":
        from dpadapter.stages import warmup

        warmup.run(cfg, args.out)
    elif args.stage == "pretrain":
        from dpadapter.stages import pretrain

        pretrain.run(cfg, args.method, args.out, args.warmup)
    elif args.stage == "finetune":
        from dpadapter.stages import finetune

        algo, strategy = split_folder(args.algo)  # `algo+strategy`: a strategy of the grid
        m = finetune.run(
            cfg, args.upstream, args.task, algo, args.eps, args.seed, args.ckpt, args.out, strategy
        )
        if m["test_accuracy"] == m["test_accuracy"]:  # another rank of a job: nan, no line
            print(f"test accuracy {m['test_accuracy']:.4f}  epsilon {m['privacy']['epsilon']:.3f}")
    elif args.stage == "aggregate":
        from dpadapter.stages import aggregate

        rows = aggregate.run(
            args.metrics,
            args.pretrain,
            list(cfg.upstreams),
            args.csv,
            args.md,
            args.paired_json,
            list(cfg.grid_algorithms()),
        )
        print(f"aggregate: {len(rows)} rows from {len(args.metrics)} runs", file=sys.stderr)
        _print_written([args.csv, args.md])
    elif args.stage == "figures":
        from dpadapter.stages import figures

        t0 = time.time()
        figures.main_figures(args.finetune_csv, args.pretrain, list(cfg.upstreams), args.out)
        _print_written(_written_since(args.out, t0))
    elif args.stage == "reference":
        from dpadapter.stages import reference

        if cfg.reference is None:
            print("error: the config has no `reference` section", file=sys.stderr)
            return 2
        reference.run(args.finetune_csv, cfg.reference, args.csv, args.md)
        print(args.md.read_text())
        _print_written([args.csv, args.md])
    elif args.stage == "table-so-far":
        from dpadapter.stages import table_so_far

        _, md = table_so_far.run(cfg, args.out)
        print(md.read_text())
        _print_written(sorted(md.parent.iterdir()))
    elif args.stage == "sweep-figures":
        from dpadapter.stages import figures

        t0 = time.time()
        figures.sweep_figures(args.pretrain, args.finetune, args.out)
        _print_written(_written_since(args.out, t0))
    elif args.stage == "hpo":
        from dpadapter.hpo.cli import run as run_hpo

        run_hpo(cfg, args)
    elif args.stage == "federated":
        from dpadapter.federated.cli import run as run_federated

        run_federated(cfg, args)
    elif args.stage == "audit":
        from dpadapter.audit.cli import run as run_audit

        run_audit(cfg, args)
    elif args.stage == "validity":
        from dpadapter.stages import validity

        a = args
        print(validity.run(a.hpo, a.federated_rule, a.finetune, a.out, a.gpu_summary, a.paired))
    elif args.stage == "report-page":
        from dpadapter.stages import report

        a = args
        report.run(cfg, a.kind, a.inputs, a.out, a.title, a.section, a.config_names, a.pretrain)
        _print_written([a.out])


if __name__ == "__main__":
    sys.exit(main())
