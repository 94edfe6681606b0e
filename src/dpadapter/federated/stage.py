"""The `federated` stage: one DP federated fine-tuning run -> metrics.json (+ one MLflow run).

Epsilon in, noise out, as in the central stage: the noise is calibrated from the target epsilon
for the exact number of releases each client will make (rounds x local steps, plus the T1
rule's estimation release when `ut_t1` is "rule"), every client's ledger records what it
actually released, and the job fails if any client's recomputed epsilon exceeds the target.
Validation accuracy is reported every `eval_every` rounds and steers nothing (not charged).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch.utils.data import TensorDataset

from dpadapter.data import build_splits
from dpadapter.federated.estimate import (
    RuleConstants,
    aggregate_constants,
    client_constants,
    client_statistics,
    privatize,
    random_directions,
    rule_decision,
)
from dpadapter.federated.mechanisms import (
    ADJACENCY,
    GAUSSIAN,
    LAPLACE,
    MECHANISMS,
    gaussian_sigma,
    laplace_noise_multiplier,
)
from dpadapter.federated.partition import dirichlet_partition
from dpadapter.federated.simulation import Client, Federation, MechanismRun
from dpadapter.ground import device as devices
from dpadapter.models import replace_head
from dpadapter.models.batchnorm import freeze_batchnorm
from dpadapter.per_sample import effective_mode, wrap_for_dp
from dpadapter.privacy import Segment, verify_plan
from dpadapter.settings import Config
from dpadapter.train.batching import wants_padding
from dpadapter.train.checkpoint import load_model
from dpadapter.train.job import seed_everything, training_job
from dpadapter.train.loops import evaluate
from dpadapter.train.progress import ProgressLine
from dpadapter.train.strategies import FT, PHASES, apply_phase, get_strategy, released_dims

STRATEGY_NAMES = ("scratch", "ht", "ft", "ut", "bitfit")
DP_LEVEL_NOTE = (
    "sample-level: each client clips and noises its own updates and keeps its own accountant; "
    "an example's guarantee is its client's epsilon, and since every example belongs to exactly "
    "one client the released global models are max_i epsilon_i - DP w.r.t. any one example. "
    "Not client-level DP (a whole client's data is not protected as one unit)."
)


def estimate_sigma(eps_e: float, delta: float) -> float:
    """Noise multiplier of the estimate's single Gaussian release costing (eps_e, delta) alone.

    dp-accounting's exact (analytic) Gaussian calibration: Opacus' RDP cannot reach small
    epsilons for one release on its alpha grid, and its PRV bisection is slow. This only sets
    the noise level; what is charged is the configured accountant's epsilon for the joint
    history (estimate + training), which the training sigma is calibrated on.
    """
    from dp_accounting.pld import accountant, common

    return float(
        accountant.get_smallest_gaussian_noise(common.DifferentialPrivacyParameters(eps_e, delta))
    )


def plan_noise(cfg: Config, mechanism: str, eps: float, releases: int, with_rule: bool):
    """(training noise multiplier, estimation noise, estimation epsilon) for one client.

    Gaussian: the estimation release alone costs `estimate_fraction * eps` (its sigma_e is
    calibrated for that); the training sigma is then calibrated on the joint history, so the
    composed epsilon is at most eps. Laplace: pure-DP budgets add, so training gets the rest.
    """
    fed, priv = cfg.federated, cfg.privacy
    cache = str(Path(cfg.results_dir) / ".cache" / "sigma.json")
    m = fed.estimate_points  # estimation releases per client, one per point of the trajectory
    if mechanism == GAUSSIAN:
        q = fed.gaussian.sample_rate
        prior, sigma_e, eps_e = [], None, 0.0
        if with_rule:
            eps_e = fed.gaussian.estimate_fraction * eps
            # m full-data Gaussian releases at sigma_e compose exactly to one at sigma_e / sqrt(m)
            sigma_e = estimate_sigma(eps_e, priv.delta) * math.sqrt(m)
            prior = [Segment(sigma_e, 1.0, m)]
        sigma = gaussian_sigma(eps, priv.delta, q, releases, priv.accountant, prior, cache)
        # either sigma may be the memo's: each client's plan is recomputed before any round
        plan = [*prior, Segment(sigma, q, releases)]
        verify_plan(plan, priv.delta, priv.accountant, eps, f"federated {mechanism} eps {eps:g}")
        return sigma, sigma_e, eps_e
    eps_e = fed.laplace.estimate_fraction * eps if with_rule else 0.0
    # pure DP adds up: each of the m estimation releases gets eps_e / m
    return laplace_noise_multiplier(eps - eps_e, releases), (eps_e / m or None), eps_e


def mechanism_run(cfg: Config, mechanism: str, noise_multiplier: float) -> MechanismRun:
    """The clients' mechanism as configured: Gaussian with Poisson rate q, Laplace on all data."""
    mc = cfg.federated.mechanism(mechanism)
    return MechanismRun(
        name=mechanism,
        max_grad_norm=mc.max_grad_norm,
        noise_multiplier=noise_multiplier,
        sample_rate=mc.sample_rate if mechanism == GAUSSIAN else 1.0,
        lr=mc.lr,
        delta=cfg.privacy.delta if mechanism == GAUSSIAN else 0.0,
        accountant=cfg.privacy.accountant,
        randomness=cfg.privacy.randomness,
    )


def estimate_points(rounds: int, m: int) -> list[int]:
    """Rounds (0-based, before the round runs) at which the constants are estimated: 0 and
    m - 1 more, evenly spaced over the first half of training (UT is in HT until the last)."""
    if m < 1:
        raise ValueError(f"estimate_points must be >= 1, got {m}")
    step = max(1, rounds // (2 * m))
    pts = sorted({min(k * step, max(rounds - 1, 0)) for k in range(m)})
    if len(pts) != m:
        raise ValueError(f"{rounds} rounds are too few for {m} estimation points")
    return pts


def estimate_constants(gsm, clients: list[Client], mech: MechanismRun, est_noise: float, cfg, seed):
    """Steps 2-3 of Algorithm 1 at the current global model (a released model, so evaluating
    the statistics there is post-processing); each client's release goes into its ledger."""
    fed = cfg.federated
    params = apply_phase(gsm, FT)
    dirs = random_directions(params, fed.estimate_directions, fed.estimate_radius, 50_000 + seed)
    dir_norms = [
        float(torch.linalg.vector_norm(torch.cat([t.reshape(-1) for t in u]))) for u in dirs
    ]
    norm = "l2" if mech.name == GAUSSIAN else "l1"
    mc = fed.mechanism(mech.name)
    # the statistics' clipping bound, in the training clipping's unit (l2 Gaussian, l1 Laplace)
    stat_clip = min(mech.max_grad_norm, mc.estimate_clip or mech.max_grad_norm)
    per_client = []
    for c in clients:
        raw = client_statistics(
            gsm, c.data, mech.max_grad_norm, norm, dirs, d_public=c.size, stat_clip=stat_clip
        )
        noisy = privatize(raw, mech.name, stat_clip, c.size, est_noise, c.noise_gen, c.ledger)
        per_client.append(client_constants(noisy, c.size, mech.sample_rate, dir_norms))
    return aggregate_constants(per_client, [c.size for c in clients])


def run(
    cfg: Config,
    upstream: str,
    strategy: str,
    mechanism: str,
    eps: float,
    rounds: int,
    seed: int,
    ckpt: Path,
    out_dir: Path,
) -> dict:
    fed = cfg.federated
    if strategy not in STRATEGY_NAMES:
        raise KeyError(f"unknown strategy {strategy!r}; known: {STRATEGY_NAMES}")
    if strategy == "scratch" and upstream != "scratch":
        raise ValueError("strategy 'scratch' is FT from the 'scratch' checkpoint")
    if mechanism not in MECHANISMS:
        raise KeyError(f"unknown mechanism {mechanism!r}; known: {MECHANISMS}")
    if not math.isfinite(eps) or eps <= 0:
        raise ValueError(f"epsilon must be positive and finite, got {eps}")
    task = fed.task or next(iter(cfg.tasks))
    seed_everything(seed)
    _, roles = build_splits(cfg, [task])
    data = roles[task]
    dev = devices.resolve(cfg.device)
    model, _ = load_model(ckpt)
    replace_head(model, data.num_classes, seed)
    freeze_batchnorm(model, cfg.finetune.bn_affine)  # as dp_fit does: public statistics only
    model.to(dev)
    data = data.to(dev)
    x, y = data.train.tensors
    parts = dirichlet_partition(
        y.cpu(), fed.clients, fed.dirichlet_alpha, fed.split_seed, fed.min_client_size
    )

    mc = fed.mechanism(mechanism)
    releases = rounds * fed.local_steps
    with_rule = strategy == "ut" and fed.ut_t1 == "rule"
    noise_multiplier, est_noise, eps_e = plan_noise(cfg, mechanism, eps, releases, with_rule)
    mech = mechanism_run(cfg, mechanism, noise_multiplier)
    # Poisson samples vary in size; on CUDA (cuDNN benchmark) they are padded to one shape.
    pad = wants_padding(cfg.finetune.pad_batches, dev)
    clients = [
        Client(i, TensorDataset(x[idx.to(x.device)], y[idx.to(y.device)]), mech, seed, dev, pad)
        for i, idx in enumerate(parts)
    ]
    # The clients' statistics (Laplace constants) read per-example gradients: bk runs hooks.
    # The checks see the data's sample shape only, the self-test a client's largest batch.
    gsm = wrap_for_dp(
        model,
        cfg.finetune.grad_sample_mode,
        True,
        (x.shape[1:], x.dtype),
        check=cfg.finetune.per_sample_check,
        check_batch=max(1, max(round(mech.sample_rate * c.size) for c in clients)),
    )
    gsm.train()

    wildcards = {
        "upstream": upstream,
        "strategy": strategy,
        "mechanism": mechanism,
        "eps": f"{eps:g}",
        "rounds": str(rounds),
        "seed": str(seed),
    }
    with training_job(cfg, "federated", wildcards, out_dir) as (run_, metrics):
        decision = consts = None
        t1 = None
        # The T1 rule: constants estimated at `estimate_points` models along the trajectory
        # (UT trains HT meanwhile), the decision taken at the last of them: T1 = T (HT
        # throughout) or T1 = that round (FT from there on; 0 with a single point).
        points = estimate_points(rounds, fed.estimate_points) if with_rule else []
        trajectory: list[dict] = []
        if with_rule:
            t1 = rounds
        name = "ft" if strategy == "scratch" else strategy
        t1_fraction = fed.ut_t1 if not isinstance(fed.ut_t1, str) else None
        schedule = get_strategy(name).schedule(rounds, t1_fraction, t1=t1)
        federation = Federation(gsm, clients, schedule, fed.local_steps)
        curve: list[dict] = []
        # A line per evaluated round in the job's log (and every few minutes in between).
        report = ProgressLine(f"federated {upstream}/{strategy}/{mechanism}/eps{eps:g}", rounds)

        def on_round(rec: dict) -> None:
            r = rec["round"]
            if r % fed.eval_every == 0 or r == rounds:
                acc = evaluate(model, data.val) if len(data.val) else float("nan")
                curve.append({**rec, "val_accuracy": acc})
                run_.log_metrics({"val_accuracy": acc, "train_loss": rec["train_loss"]}, step=r)
                line = {**rec, "steps": r, "val_accuracy": acc}
                report.epoch(r, rounds, {**line, "noise_multiplier": noise_multiplier}, "round")
            else:
                report.step(r, rec["train_loss"])

        estimates: list[RuleConstants] = []
        for t in range(rounds):
            if t in points:
                k = len(estimates)
                c_k = estimate_constants(gsm, clients, mech, est_noise, cfg, seed + 1000 * k)
                estimates.append(c_k)
                trajectory.append({"round": t, "constants": c_k.__dict__})
                if t == points[-1]:
                    sizes = [c.size for c in clients]
                    decision, consts = rule_decision(
                        estimates, rounds, sizes, mech, released_dims(gsm)
                    )
                    if not decision.step_size_condition:
                        print(
                            f"warning: T1 rule outside Theorems 2-3: lr {mech.lr:g} >= "
                            f"1/(2L) = {decision.lr_bound:.4g} (L = {decision.L_check:.4g})"
                        )
                    schedule = get_strategy("ut").schedule(
                        rounds, t1=rounds if decision.predicted_best == "ht" else t
                    )
                    federation.schedule = schedule
            on_round(federation.round(t))
        # HT's and FT's dimensions always (the T1 rule's n and p + n), and any other phase run
        run_phases = [ph["phase"] for ph in schedule.phases()]
        dims = released_dims(model, (*PHASES, *(p for p in run_phases if p not in PHASES)))
        for p in model.parameters():
            p.requires_grad_(True)

        eps_cache: dict[tuple, float] = {}
        per_client = []
        for c in clients:
            key = tuple(s.as_tuple() for s in c.ledger.history)
            if key not in eps_cache:
                eps_cache[key] = c.ledger.epsilon()
            per_client.append(
                {
                    "client": c.index,
                    "n": c.size,
                    "epsilon": eps_cache[key],
                    "steps": c.ledger.steps,
                    "history": c.ledger.state_dict()["history"],
                }
            )
        spent = max(pc["epsilon"] for pc in per_client)
        if spent > eps * 1.001:
            raise RuntimeError(f"a client spent epsilon {spent:.4f} > target {eps}")

        hyper = {
            "algorithm": "fedsgd" if fed.local_steps == 1 else "fedavg",
            "strategy": strategy,
            "effective_strategy": name,
            "lr": mc.lr,
            "rounds": rounds,
            "local_steps": fed.local_steps,
            "clients": fed.clients,
            "dirichlet_alpha": fed.dirichlet_alpha,
            "split_seed": fed.split_seed,
            "max_grad_norm": mc.max_grad_norm,
            "noise_multiplier": noise_multiplier,
            "sample_rate": mech.sample_rate,
            "grad_sample_mode": cfg.finetune.grad_sample_mode,
            "grad_sample_mode_run": effective_mode(cfg.finetune.grad_sample_mode, True),
            "task": task,
            "seed": seed,
        }
        run_.log_params(hyper)
        test_acc = evaluate(model, data.test)
        metrics.update(
            {
                "test_accuracy": test_acc,
                "val_accuracy": curve[-1]["val_accuracy"] if curve else None,
                "hyperparameters": hyper,
                "per_sample_check": gsm.per_sample_check,
                "frozen_statistics": list(gsm.independence.frozen),
                "federation": {
                    "algorithm": hyper["algorithm"],
                    "clients": fed.clients,
                    "client_sizes": [c.size for c in clients],
                    "aggregation": "theta = sum_i (d_i / d) theta_i (weighted by client data size)",
                    "partition": f"Dirichlet(alpha={fed.dirichlet_alpha}) per class, "
                    f"seed {fed.split_seed}",
                },
                "schedule": {
                    "t1": schedule.t1,
                    "rounds": rounds,
                    "phases": schedule.phases(),
                    "released_dims": dims,
                    "t1_source": "rule" if with_rule else ("config" if name == "ut" else "fixed"),
                },
                "privacy": {
                    "mechanism": mechanism,
                    "dp_level": "sample",
                    "dp_level_note": DP_LEVEL_NOTE,
                    "adjacency": ADJACENCY[mechanism],
                    "accountant": clients[0].ledger.accountant,
                    "target_epsilon": eps,
                    "epsilon": spent,
                    "delta": mech.delta,
                    "clipping": "l2" if mechanism == GAUSSIAN else "l1",
                    "max_grad_norm": mc.max_grad_norm,
                    "noise_multiplier": noise_multiplier,
                    "sample_rate": mech.sample_rate,
                    "sampling": "poisson" if mechanism == GAUSSIAN else "full batch",
                    "releases_per_client": releases + (len(points) if with_rule else 0),
                    "estimation": (
                        {
                            "epsilon_alone": eps_e,
                            "noise": est_noise,
                            "points": points,
                            "charged": True,
                        }
                        if with_rule
                        else None
                    ),
                    "accountant_scope": "one ledger per client for the whole run, never reset",
                    "clients": per_client,
                    "validation_use": "reported only; selects nothing, so it is not charged",
                    **(
                        {
                            "laplace_scale_per_client": [
                                mech.noise_multiplier * mc.max_grad_norm / c.size for c in clients
                            ]
                        }
                        if mechanism == LAPLACE
                        else {}
                    ),
                },
                "curve": curve,
                "rule": (
                    {
                        **decision.as_dict(),
                        "t1_run": schedule.t1,
                        "constants": consts.__dict__,
                        "trajectory": trajectory,
                        "step_size_assumption": (
                            "holds" if decision.step_size_condition else "does NOT hold"
                        )
                        + f": lr {mech.lr:g} vs 1/(2L) = {decision.lr_bound:.4g} with the "
                        "largest L estimated along the trajectory (Theorems 2-3 need lr < 1/(2L))",
                    }
                    if decision is not None
                    else None
                ),
                "predicted_best": decision.predicted_best if decision is not None else None,
            }
        )
        run_.log_metrics(
            {"test_accuracy": test_acc, "epsilon": spent, "noise_multiplier": noise_multiplier}
        )
    return metrics
