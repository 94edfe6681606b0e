"""`python -m dpadapter --config C hpo <step> ...`: the entry points of workflow/rules/hpo*.smk.

Kept apart from `dpadapter.launch.cli` so that the shared parser only gains one line per hook;
nothing
heavy is imported until a step runs.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from dpadapter.settings import Config


def add_parsers(parser: argparse.ArgumentParser) -> None:
    steps = parser.add_subparsers(dest="hpo_step", required=True)
    p = steps.add_parser("plan", help="fix every trial's and the final run's privacy parameters")
    for k in ("upstream", "task", "algo"):
        p.add_argument(f"--{k}", required=True)
    p.add_argument("--seed", required=True, type=int)
    p.add_argument("--out", required=True, type=Path)
    t = steps.add_parser("trial", help="one trial of one sweep")
    t.add_argument("--plan", required=True, type=Path)
    t.add_argument("--sweep", required=True, type=int)
    t.add_argument("--trial", required=True, type=int)
    t.add_argument("--ckpt", required=True, type=Path)
    t.add_argument("--out", required=True, type=Path)
    s = steps.add_parser("sweep", help="private selection of a sweep's best trial")
    s.add_argument("--plan", required=True, type=Path)
    s.add_argument("--sweep", required=True, type=int)
    s.add_argument("--trials", required=True, nargs="+", type=Path)
    s.add_argument("--out", required=True, type=Path)
    f = steps.add_parser("fit", help="r(eps) through the sweeps' best r; r* for the final run")
    f.add_argument("--plan", required=True, type=Path)
    f.add_argument("--sweeps", required=True, nargs="+", type=Path)
    f.add_argument("--out", required=True, type=Path)
    fi = steps.add_parser("final", help="train with r* at the final budget; account everything")
    fi.add_argument("--plan", required=True, type=Path)
    fi.add_argument("--fit", required=True, type=Path)
    fi.add_argument("--sweeps", required=True, nargs="+", type=Path)
    fi.add_argument("--trials", required=True, nargs="+", type=Path)
    fi.add_argument("--ckpt", required=True, type=Path)
    fi.add_argument("--out", required=True, type=Path)
    r = steps.add_parser("random-search", help="baseline: one run at a random r, whole budget")
    r.add_argument("--plan", required=True, type=Path)
    r.add_argument("--ckpt", required=True, type=Path)
    r.add_argument("--out", required=True, type=Path)
    g = steps.add_parser("grid-run", help="one point of the r grid at the whole budget")
    g.add_argument("--plan", required=True, type=Path)
    g.add_argument("--point", required=True, type=int)
    g.add_argument("--ckpt", required=True, type=Path)
    g.add_argument("--out", required=True, type=Path)
    o = steps.add_parser("grid-oracle", help="baseline: best grid point (tuning not accounted)")
    o.add_argument("--plan", required=True, type=Path)
    o.add_argument("--runs", required=True, nargs="+", type=Path)
    o.add_argument("--out", required=True, type=Path)
    fe = steps.add_parser("features", help="linear-probe: frozen features of a task, once")
    fe.add_argument("--task", required=True)
    fe.add_argument("--ckpt", required=True, type=Path)
    fe.add_argument("--out", required=True, type=Path)
    po = steps.add_parser("probe-oracle", help="linear-probe: grid x budgets x seeds, premise")
    po.add_argument("--features", required=True, type=Path)
    po.add_argument("--out", required=True, type=Path)
    ps = steps.add_parser("probe-seed", help="linear-probe: one HPO replicate at every target")
    ps.add_argument("--features", required=True, type=Path)
    ps.add_argument("--seed", required=True, type=int)
    ps.add_argument("--out", required=True, type=Path)
    pm = steps.add_parser("probe-summary", help="linear-probe: hpo.csv, hpo.md, hpo.json")
    pm.add_argument("--oracle", required=True, nargs="+", type=Path)
    pm.add_argument("--seeds", required=True, nargs="+", type=Path)
    pm.add_argument("--csv", required=True, type=Path)
    pm.add_argument("--md", required=True, type=Path)
    pm.add_argument("--json", required=True, type=Path)
    su = steps.add_parser("summary", help="hpo.csv and hpo.md")
    su.add_argument("--final", required=True, nargs="+", type=Path)
    su.add_argument("--random", required=True, nargs="+", type=Path)
    su.add_argument("--oracle", required=True, nargs="+", type=Path)
    su.add_argument("--csv", required=True, type=Path)
    su.add_argument("--md", required=True, type=Path)


def run(cfg: Config, args: argparse.Namespace) -> None:
    if args.hpo_step in ("features", "probe-oracle", "probe-seed", "probe-summary"):
        _probe(cfg, args)
    else:
        _network(cfg, args)


def _network(cfg: Config, a: argparse.Namespace) -> None:
    """The network regime's steps (`dpadapter.hpo.network`)."""
    from dpadapter.hpo.network import baselines, final, plan, summary, trials

    if a.hpo_step == "plan":
        p = plan.plan(cfg, a.upstream, a.task, a.algo, a.seed, a.out)
        total = p["planned_total_epsilon"]
        print(f"final epsilon {p['final']['epsilon']:.4f}  planned total {total:.4f}")
    elif a.hpo_step == "trial":
        m = trials.trial(cfg, a.plan, a.sweep, a.trial, a.ckpt, a.out)
        print(f"trial r={m['hpo']['r']:.4g} epsilon {m['privacy']['epsilon']:.4f}")
    elif a.hpo_step == "sweep":
        s = trials.sweep(cfg, a.plan, a.sweep, a.trials, a.out)
        print(f"sweep {a.sweep}: chose trial {s['chosen']} (r={s['r']:.4g})")
    elif a.hpo_step == "fit":
        f = final.fit(cfg, a.plan, a.sweeps, a.out)
        print(f"r* = {f['r_star']:.4g} (predicted {f['r_predicted']:.4g})")
    elif a.hpo_step == "final":
        m = final.final(cfg, a.plan, a.fit, a.sweeps, a.trials, a.ckpt, a.out)
        print(
            f"test accuracy {m['test_accuracy']:.4f}  total epsilon {m['hpo']['total_epsilon']:.4f}"
        )
    elif a.hpo_step == "random-search":
        m = baselines.random_search(cfg, a.plan, a.ckpt, a.out)
        print(f"test accuracy {m['test_accuracy']:.4f}")
    elif a.hpo_step == "grid-run":
        m = baselines.grid_run(cfg, a.plan, a.point, a.ckpt, a.out)
        print(f"test accuracy {m['test_accuracy']:.4f}")
    elif a.hpo_step == "grid-oracle":
        o = baselines.grid_oracle(cfg, a.plan, a.runs, a.out)
        print(f"oracle r={o['r']:.4g} test accuracy {o['test_accuracy']:.4f}")
    elif a.hpo_step == "summary":
        summary.run(a.final, a.random, a.oracle, a.csv, a.md)
        print(a.md.read_text())


def _probe(cfg: Config, a: argparse.Namespace) -> None:
    """The linear-probe regime's steps (`dpadapter.hpo.probe`)."""
    import json

    from dpadapter.hpo.probe import features, oracle, replicate, summary
    from dpadapter.train.job import write_json

    if a.hpo_step == "features":
        p = features.compute(cfg, a.task, a.ckpt, a.out)
        print(f"features {tuple(p['train']['x'].shape)} (train), {len(p['test']['y'])} test")
    elif a.hpo_step == "probe-oracle":
        o = oracle.oracle(cfg, a.features)
        write_json(a.out, o)
        print(json.dumps(o["premise"]))
    elif a.hpo_step == "probe-seed":
        write_json(a.out, replicate.seed_run(cfg, a.features, a.seed))
    else:
        summary.run(a.oracle, a.seeds, a.csv, a.md, a.json)
        print(a.md.read_text())
