"""Typed, frozen views of `config.yaml`.

The YAML is validated against `workflow/schemas/config.schema.yaml` first (so a bad key is
reported by name before any job starts); these dataclasses are what the code reads, so a
stage never digs into raw dicts and every default lives in one place.

This module imports no registry (the registries import its dataclasses): checks that need
the registries (names, per-method params schemas, dataset sizes, privacy sanity) live in
`dpadapter.validation`, which the workflow and the CLI call.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from dpadapter import atomic
from dpadapter.param_schema import mixed_alternatives

REPO_ROOT = Path(__file__).resolve().parents[2]
SCHEMA_PATH = REPO_ROOT / "workflow" / "schemas" / "config.schema.yaml"


class ConfigError(ValueError):
    """A config value is wrong; the message names the key."""


@dataclass(frozen=True)
class SplitConfig:
    """One role (public set or a private task) carved out of a source dataset."""

    dataset: str
    classes: tuple[int, ...] | None = None
    n_train: int | None = None
    n_val: int = 0
    n_test: int | None = None
    # False: carved like any task (after the ones before it) but left out of the fine-tuning
    # grids (finetune, sweeps); only a stage that names it (hpo, federated) uses it.
    grids: bool = True
    # Which split of the source the role's training (+ validation) and test examples come from:
    # "train" or "test". Default: train from train, test from test. DP-SAT's "0.8:0.2" split of
    # the training data is test_split: train (configs/dpsat-table2*.yaml).
    train_split: str = "train"
    test_split: str = "test"
    # Replicate 1-channel images to this many channels (null: as the source); e.g. 3 for a
    # grey task on an RGB backbone (Pretrain-DPFL's Fashion-MNIST as 3x32x32).
    channels: int | None = None


@dataclass(frozen=True)
class DataConfig:
    root: str = "data"
    download: bool = False
    split_seed: int = 0
    image_size: int | None = None
    # Fixed per-channel normalisation constants (public numbers, e.g. the ones a paper's code
    # uses); None derives them from the public training images (dpadapter.data.tasks).
    normalization: tuple[tuple[float, ...], tuple[float, ...]] | None = None


@dataclass(frozen=True)
class ModelConfig:
    name: str = "cnn-gn"
    groups: int = 8
    width: int = 16
    # BatchNorm of a timm/external backbone (dpadapter.models.batchnorm): freeze | groupnorm
    batchnorm: str = "freeze"


@dataclass(frozen=True)
class SGDConfig:
    """Non-private SGD with momentum and a step LR schedule (warm-up and upstream methods)."""

    epochs: int = 3
    batch_size: int = 128
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 5e-4
    milestones: tuple[int, ...] = ()
    lr_gamma: float = 0.1
    max_steps: int | None = None
    # "epochs": milestones count epochs and the run lasts `epochs` (capped by max_steps);
    # "steps": milestones count update steps and the run lasts exactly `max_steps` steps
    # (Algorithm 1's K as iterations; DPAdapter's Section 5.1 says "1000 epochs").
    schedule_unit: str = "epochs"


@dataclass(frozen=True)
class RobustnessConfig:
    noise_std: float = 0.1
    draws: int = 3
    seed: int = 1234


@dataclass(frozen=True)
class PrivacyConfig:
    delta: float = 1e-5
    accountant: str = "prv"
    # Where the DP mechanisms' noise and Poisson masks come from (dpadapter.privacy.randomness):
    # the job's seed (reproducible research runs) or the OS's cryptographic source (deployments:
    # a guarantee against whoever reads the config and metrics.json too).
    randomness: str = "seeded"

    def __post_init__(self) -> None:
        if self.randomness not in RANDOMNESS:
            raise ConfigError(
                f"invalid config:\n  privacy.randomness: {self.randomness!r} is not one of "
                f"{sorted(RANDOMNESS)}"
            )

    def randomness_record(self) -> dict[str, str]:
        """What every job's metrics.json says of where its noise and sampling came from."""
        return {"mode": self.randomness, "noise_and_sampling": RANDOMNESS[self.randomness]}


# privacy.randomness: each mode and what metrics.json says of it
RANDOMNESS = {
    "seeded": "torch generators seeded from the job's seed: reproducible, and no DP guarantee "
    "against anyone who knows the seed",
    "secret": "drawn at each release from the OS's cryptographic source (os.urandom); no seed "
    "or generator state exists for them, none is recorded",
}


@dataclass(frozen=True)
class GridConfig:
    """A sub-grid of fine-tuning jobs; empty fields mean 'as in the main grid'."""

    algorithms: tuple[str, ...]
    upstreams: tuple[str, ...] = ()
    tasks: tuple[str, ...] = ()
    epsilons: tuple[float, ...] = ()
    seeds: tuple[int, ...] = ()


@dataclass(frozen=True)
class ParamsFor:
    """Algorithm params for some upstreams and tasks only (empty = all of them).

    A published table may tune a hyperparameter per model and dataset (DP-SAT Table 3's
    radius): entries apply in order on top of `finetune.algo_params`, each algorithm's dict
    merged key by key.
    """

    algo_params: dict[str, dict[str, Any]]
    upstreams: tuple[str, ...] = ()
    tasks: tuple[str, ...] = ()

    def applies(self, upstream: str | None, task: str | None) -> bool:
        return (not self.upstreams or upstream in self.upstreams) and (
            not self.tasks or task in self.tasks
        )


@dataclass(frozen=True)
class FinetuneConfig:
    algorithms: tuple[str, ...] = ("dpsgd",)
    epsilons: tuple[float, ...] = (1.0, 4.0)
    seeds: tuple[int, ...] = (0,)
    upstreams: tuple[str, ...] = ()  # main grid's upstream methods; empty = pretrain.methods
    batch_size: int = 200
    epochs: int = 10
    lr: float = 0.5
    momentum: float = 0.0
    optimizer: str = "sgd"  # sgd (with momentum) or adam: what the DP optimizer wraps
    max_grad_norm: float = 1.0
    # bk (book-keeping clipping); an algorithm or stage that reads per-example gradients
    # itself (GEP, the federated clients) runs Opacus' hooks under bk (train.per_sample)
    grad_sample_mode: str = "bk"
    # autocast of the DP step (train.per_sample.precision): fp32 (none), bf16, fp16 (loss scale)
    precision: str = "fp32"
    # the per-sample self-test at wrap time (dpadapter.train.per_sample.self_test)
    per_sample_check: bool = True
    physical_batch_size: int | None = None
    # pad physical batches (and federated clients' samples) to one shape: auto = on CUDA only
    pad_batches: bool | str = "auto"
    # How the Poisson rate q follows from batch_size (dpadapter.train.dp_spec.sample_rate):
    # "batch_size": q = batch_size / n; "loader": q = 1 / ceil(n / batch_size), what Opacus'
    # make_private gives a DataLoader(batch_size) (the DP-SAT paper's code).
    sample_rate_from: str = "batch_size"
    extra_grids: tuple[GridConfig, ...] = ()
    algo_params: dict[str, dict[str, Any]] = field(default_factory=dict)
    algo_params_for: tuple[ParamsFor, ...] = ()
    strategy: str = "ft"  # dpadapter.strategies: ft (all), ht (head), ut (HT, FT), bitfit
    ut_t1_fraction: float = 0.5  # ut: share of the steps that are head-tuning
    # frozen BatchNorms' scale and shift under DP: train (per example) | freeze (models.batchnorm)
    bn_affine: str = "train"

    def params_of(
        self, algo: str, upstream: str | None = None, task: str | None = None
    ) -> dict[str, Any]:
        """`algo`'s params for a job on (upstream, task): `algo_params`, then the overrides."""
        out = dict(self.algo_params.get(algo, {}))
        for entry in self.algo_params_for:
            if entry.applies(upstream, task):
                out.update(entry.algo_params.get(algo, {}))
        return out


@dataclass(frozen=True)
class HPOConfig:
    """Private HPO with the linear scaling rule (`dpadapter.hpo`, Panda et al. 2024).

    Trials at the small per-run budgets `sweep_epsilons` (n = `trials_per_sweep` each) pick the
    best total step size r = lr * steps at each budget, a line (or quadratic) through those
    points predicts r for the final run, and the final run's budget is whatever keeps the
    composition of every trial, every selection and the final run within `target_epsilon`.
    Empty `upstreams`/`tasks` mean all of them. `steps` count optimizer steps (releases).
    `monotone` floors r* at the sweeps' best r (the rule's prior: r does not fall as eps grows).
    """

    upstreams: tuple[str, ...] = ()
    tasks: tuple[str, ...] = ()
    algorithms: tuple[str, ...] = ("dpsgd",)
    seeds: tuple[int, ...] = (0,)
    target_epsilon: float = 1.0
    sweep_epsilons: tuple[float, ...] = (0.1, 0.2)
    trials_per_sweep: int = 3
    fit: str = "linear"
    monotone: bool = False
    lr_range: tuple[float, float] = (0.05, 2.0)
    steps_range: tuple[int, int] = (10, 60)
    grid_size: int = 8
    selection: str = "exponential"
    selection_epsilon: float = 0.05
    selection_noise_std: float = 25.0
    # `regime`: "network" fine-tunes the checkpoint with the registered algorithm (one job per
    # trial); "linear-probe" is the paper's regime (`dpadapter.hpo.probe`): a zero-initialised
    # linear head on frozen features, full-batch DP-GD with `momentum`, at every
    # `target_epsilons` budget, the oracle over `oracle_seeds` training seeds per grid point.
    regime: str = "linear-probe"
    strategy: str | None = None  # network regime: ft/ht/ut/bitfit; None = finetune.strategy
    target_epsilons: tuple[float, ...] = (1.0,)  # the paper's total budget; sweeps must be below
    oracle_seeds: int = 3
    momentum: float = 0.9
    max_grad_norm: float = 1.0

    def __post_init__(self) -> None:
        if self.regime != "linear-probe":
            return
        low = min(self.target_epsilons, default=None)
        if low is None:
            raise ConfigError("invalid config:\n  hpo.target_epsilons: linear-probe needs >= 1")
        if self.sweep_epsilons and max(self.sweep_epsilons) >= low:
            raise ConfigError(
                "invalid config:\n  hpo.sweep_epsilons: every sweep budget must be below the "
                f"smallest of hpo.target_epsilons ({low})"
            )

    @property
    def budgets(self) -> tuple[float, ...]:
        """The total budgets the HPO is run for: one per target."""
        return self.target_epsilons if self.regime == "linear-probe" else (self.target_epsilon,)


@dataclass(frozen=True)
class FedMechanismConfig:
    """One client-side DP mechanism of the federated stage (`dpadapter.federated`).

    `max_grad_norm` is the per-example clipping bound: l2 (xi_2) for Gaussian, l1 (xi_1) for
    Laplace. `sample_rate` is the Gaussian clients' Poisson rate; Laplace (Theorem 1) always
    uses every example, so its rate must be 1.
    """

    epsilons: tuple[float, ...]
    max_grad_norm: float
    lr: float
    sample_rate: float = 1.0
    estimate_fraction: float = 0.1  # share of epsilon paying for the T1 rule's estimates
    # bound inside the estimates, in the training clipping's unit; None = max_grad_norm
    estimate_clip: float | None = None


def _fed_gaussian() -> FedMechanismConfig:
    return FedMechanismConfig(
        epsilons=(0.5, 2.0, 8.0), max_grad_norm=1.0, lr=1.5, sample_rate=0.2, estimate_fraction=0.2
    )


def _fed_laplace() -> FedMechanismConfig:
    return FedMechanismConfig(
        epsilons=(25.0, 100.0, 400.0),
        max_grad_norm=10.0,
        lr=1.0,
        estimate_fraction=0.05,
        estimate_clip=1.0,
    )


@dataclass(frozen=True)
class FederatedConfig:
    """DP federated fine-tuning (Pretrain-DPFL): FedSGD/FedAvg over Dirichlet-split clients.

    Grid: each pre-trained upstream x `strategies` (ht, ft, ut; bitfit on request), plus
    `scratch` (FT from the random-init checkpoint), x mechanism x its epsilons x seeds, at
    `rounds` rounds; `rounds_sweep` adds the same strategies at other round counts, at
    `sweep_epsilons[mechanism]`. `ut_t1` is "rule" (Theorems 2-3 from privately estimated
    constants; the mechanism's `estimate_fraction` of the budget pays for the estimate) or a
    fraction of the rounds.
    """

    task: str | None = None
    upstreams: tuple[str, ...] = ()
    strategies: tuple[str, ...] = ("scratch", "ht", "ft", "ut")
    mechanisms: tuple[str, ...] = ("gaussian", "laplace")
    seeds: tuple[int, ...] = (0, 1)
    clients: int = 10
    dirichlet_alpha: float = 1.0
    min_client_size: int = 20
    split_seed: int = 0
    rounds: int = 20
    local_steps: int = 1
    ut_t1: str | float = "rule"
    estimate_directions: int = 2
    estimate_radius: float = 0.01
    estimate_points: int = 1  # models along the trajectory the T1 rule's constants come from
    eval_every: int = 5
    rounds_sweep: tuple[int, ...] = (10, 40)
    sweep_seeds: tuple[int, ...] = ()  # seeds of the rounds sweep; () = `seeds`
    sweep_epsilons: dict[str, float] = field(
        default_factory=lambda: {"gaussian": 2.0, "laplace": 100.0}
    )
    gaussian: FedMechanismConfig = field(default_factory=_fed_gaussian)
    laplace: FedMechanismConfig = field(default_factory=_fed_laplace)

    def mechanism(self, name: str) -> FedMechanismConfig:
        return {"gaussian": self.gaussian, "laplace": self.laplace}[name]

    def pretrained(self, methods: tuple[str, ...]) -> tuple[str, ...]:
        """Upstreams fine-tuned by ht/ft/ut: as configured, else every method but scratch."""
        return self.upstreams or tuple(m for m in methods if m != "scratch")

    def jobs(self, methods: tuple[str, ...]) -> list[tuple[str, str, str, float, int, int]]:
        """Every (upstream, strategy, mechanism, epsilon, rounds, seed), no duplicates.

        `scratch` runs once, on the `scratch` checkpoint, whatever the upstreams.
        """
        cells: list[tuple[str, float, int]] = [
            (m, float(e), self.rounds) for m in self.mechanisms for e in self.mechanism(m).epsilons
        ]
        for t in self.rounds_sweep:
            for m in self.mechanisms:
                if m in self.sweep_epsilons:
                    cells.append((m, float(self.sweep_epsilons[m]), int(t)))
        pairs = [("scratch", "scratch")] if "scratch" in self.strategies else []
        tuned = [s for s in self.strategies if s != "scratch"]
        pairs += [(u, s) for u in self.pretrained(methods) for s in tuned]
        jobs: dict[tuple, None] = {}
        for m, e, t in cells:
            seeds = self.seeds if t == self.rounds else (self.sweep_seeds or self.seeds)
            for u, s in pairs:
                for seed in seeds:
                    jobs[(u, s, m, e, t, int(seed))] = None
        return list(jobs)


@dataclass(frozen=True)
class TrackingConfig:
    uri: str | None = None
    experiment: str = "dpadapter"
    # "auto": on where mlflow imports and the store answers, else the job runs untracked and
    # says so once; True: either missing is an error before training; False: mlflow unused.
    enabled: bool | str = "auto"


@dataclass(frozen=True)
class SweepConfig:
    """The paper's gamma sweeps (Figs. 5 and 6): upstream methods at several radii."""

    gammas: tuple[float, ...] = (0.1, 0.5, 1.0, 2.0)
    methods: tuple[str, ...] = ("sam", "dpadapter")
    tasks: tuple[str, ...] = ()
    algorithm: str = "dpsgd"
    epsilon: float = 1.0
    seeds: tuple[int, ...] = (0,)


@dataclass(frozen=True)
class AuditConfig:
    """Empirical privacy audit (`dpadapter.audit`; Steinke, Nasr & Jagielski 2023, one run).

    One run per algorithm x epsilon on `task` (None = the first task) with `canaries` inserted,
    each with probability 1/2; empty `algorithms` = every registered one. Training settings are
    `finetune`'s (`epochs` None = finetune.epochs; `n_real` None = the whole training split).
    Each of `scores` x `guesses` (top-k / bottom-k) is one test; the reported lower bound is
    their maximum at `confidence` overall (Bonferroni). `federated`: federated mechanisms
    audited per client (the `federated` section's setting, canaries in client 0).
    """

    algorithms: tuple[str, ...] = ()
    epsilons: tuple[float, ...] = (1.0, 4.0)
    task: str | None = None
    canaries: int = 2000
    canary_scale: float = 10.0
    guesses: tuple[int, ...] = (200, 400, 600)
    scores: tuple[str, ...] = ("whitebox", "blackbox")
    confidence: float = 0.95
    epochs: int | None = None
    n_real: int | None = None
    seed: int = 0
    federated: tuple[str, ...] = ("gaussian", "laplace")  # mechanisms audited (client 0)


def _audit(d: dict[str, Any]) -> AuditConfig:
    out = _tuplify(d, ("algorithms", "epsilons", "guesses", "scores", "federated"))
    if "epsilons" in out:
        out["epsilons"] = tuple(float(e) for e in out["epsilons"])
    return AuditConfig(**out)


@dataclass(frozen=True)
class ReferenceCell:
    algorithm: str
    epsilon: float
    mean: float  # test accuracy %, as published
    std: float = 0.0
    # A table with several models or datasets (DP-SAT Table 3): this cell's own upstream and
    # task; None = the reference's.
    upstream: str | None = None
    task: str | None = None


@dataclass(frozen=True)
class ReferenceConfig:
    """A published table to reproduce: its cells, and which of our runs they compare with."""

    name: str
    source: str
    upstream: str
    task: str
    cells: tuple[ReferenceCell, ...]
    baseline: str = "dpsgd"  # ERR = error-rate reduction of `improved` over `baseline`
    improved: str = "dpsat"
    notes: str = ""


def _reference(d: dict[str, Any] | None) -> ReferenceConfig | None:
    if not d:
        return None
    cells = tuple(ReferenceCell(**c) for c in d.get("cells", ()))
    return ReferenceConfig(**{**d, "cells": cells})


@dataclass(frozen=True)
class Config:
    data: DataConfig
    public: SplitConfig
    tasks: dict[str, SplitConfig]
    model: ModelConfig
    warmup: SGDConfig
    upstreams: tuple[str, ...]
    upstream_params: dict[str, dict[str, Any]]
    finetune: FinetuneConfig
    privacy: PrivacyConfig
    robustness: RobustnessConfig
    tracking: TrackingConfig
    results_dir: str = "results"
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda[:i]; $DPADAPTER_DEVICE overrides (dpadapter.device)
    tf32: bool = True  # TF32 matmuls/convolutions on CUDA
    reference: ReferenceConfig | None = None  # a published table shown beside ours
    hpo: HPOConfig = field(default_factory=HPOConfig)
    federated: FederatedConfig = field(default_factory=FederatedConfig)
    sweeps: SweepConfig = field(default_factory=SweepConfig)
    audit: AuditConfig = field(default_factory=AuditConfig)
    # `pretrain.external`: label -> params of the `external` method (dpadapter.upstream.resolve)
    external_upstreams: dict[str, dict[str, Any]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def grid_tasks(self) -> tuple[str, ...]:
        """Tasks the fine-tuning grids use by default: every task not marked `grids: false`."""
        return tuple(n for n, t in self.tasks.items() if t.grids)

    def finetune_grid(self) -> list[tuple[str, str, str, float, int]]:
        """Every (upstream, task, algorithm, epsilon, seed) job, main grid first, no duplicates."""
        ft = self.finetune
        grids = [GridConfig(ft.algorithms, upstreams=ft.upstreams)] + list(ft.extra_grids)
        jobs: dict[tuple, None] = {}
        for g in grids:
            for u in g.upstreams or self.upstreams:
                for t in g.tasks or self.grid_tasks():
                    for a in g.algorithms:
                        for e in g.epsilons or ft.epsilons:
                            for s in g.seeds or ft.seeds:
                                jobs[(u, t, a, float(e), int(s))] = None
        return list(jobs)


def _tuplify(d: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    out = dict(d)
    for k in keys:
        if k in out and out[k] is not None:
            out[k] = tuple(out[k])
    return out


def _split(d: dict[str, Any]) -> SplitConfig:
    return SplitConfig(**_tuplify(d, ("classes",)))


def _hpo(d: dict[str, Any]) -> HPOConfig:
    keys = ("upstreams", "tasks", "algorithms", "seeds", "sweep_epsilons")
    keys += ("lr_range", "steps_range", "target_epsilons")
    out = _tuplify(d, keys)
    for k in ("sweep_epsilons", "target_epsilons"):
        if k in out:
            out[k] = tuple(float(e) for e in out[k])
    return HPOConfig(**out)


def _federated(d: dict[str, Any], methods: tuple[str, ...]) -> FederatedConfig:
    keys = ("upstreams", "strategies", "mechanisms", "seeds", "rounds_sweep", "sweep_seeds")
    out = _tuplify(d, keys)
    if "scratch" not in methods:  # the default strategies: scratch only with its checkpoint
        out.setdefault("strategies", ("ht", "ft", "ut"))
    for m in ("gaussian", "laplace"):
        if m in out:
            mech = _tuplify(out[m], ("epsilons",))
            if "epsilons" in mech:
                mech["epsilons"] = tuple(float(e) for e in mech["epsilons"])
            base = _fed_gaussian() if m == "gaussian" else _fed_laplace()
            out[m] = dataclasses.replace(base, **mech)
    if "sweep_epsilons" in out:
        out["sweep_epsilons"] = {k: float(v) for k, v in out["sweep_epsilons"].items()}
    return FederatedConfig(**out)


def base_schema() -> dict[str, Any]:
    """The config's JSON schema as written, without the registries' params schemas."""
    return yaml.safe_load(SCHEMA_PATH.read_text())


# A YAML 1.1 float needs a dot: PyYAML reads `1e-5` (and anything quoted) as a string.
_NUMBER_TEXT = re.compile(r"^\s*[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?\s*$")


def _schema_message(err: Any) -> list[str]:
    """Lines for one jsonschema error, each starting with the full dotted key it concerns."""
    where = ".".join(str(p) for p in err.absolute_path)
    if err.validator == "additionalProperties" and isinstance(err.instance, dict):
        known = sorted(err.schema.get("properties", {}))
        what = "parameter" if err.schema.get("x-params") else "key"
        return [
            f"{where + '.' if where else ''}{k}: unknown {what}; known: {known}"
            for k in err.instance
            if k not in known
        ]
    mixed = mixed_alternatives(err, where)
    if mixed:
        return [mixed]
    msg = err.message
    if isinstance(err.instance, str) and _NUMBER_TEXT.match(err.instance):
        mantissa, *exponent = re.split("[eE]", err.instance.strip())
        if exponent and "." not in mantissa:
            fixed = f"{mantissa}.0e{exponent[0]}"
            msg += f" (YAML reads an exponent without a dot as text: write {fixed})"
        else:
            msg += f" (a number in quotes is text: write {err.instance.strip()} unquoted)"
    return [f"{where or '<top level>'}: {msg}"]


def validate_raw(raw: dict[str, Any], schema: dict[str, Any] | None = None) -> None:
    """Check the raw mapping against the JSON schema; raise ConfigError naming every bad key.

    `schema` defaults to the file as written; `dpadapter.validation` passes it with the
    registries' params schemas plugged in.
    """
    import jsonschema

    validator = jsonschema.Draft202012Validator(schema or base_schema())
    errors = sorted(validator.iter_errors(raw), key=lambda e: [str(p) for p in e.absolute_path])
    if errors:
        lines = [line for err in errors for line in _schema_message(err)]
        raise ConfigError("invalid config:\n" + "\n".join(f"  {line}" for line in lines))


def _data(raw: dict[str, Any]) -> DataConfig:
    d = dict(raw)
    norm = d.pop("normalization", None)
    if norm is not None:
        norm = (tuple(float(v) for v in norm["mean"]), tuple(float(v) for v in norm["std"]))
        if len(norm[0]) != len(norm[1]):
            raise ConfigError(
                f"data.normalization: {len(norm[0])} mean(s) but {len(norm[1])} std(s)"
            )
    return DataConfig(**d, normalization=norm)


# `pretrain.methods` when a config names none.
DEFAULT_METHODS = ("scratch", "standard")


def from_dict(raw: dict[str, Any], validate: bool = True) -> Config:
    if validate:
        validate_raw(raw)
    ft = dict(raw.get("finetune", {}))
    ft = _tuplify(ft, ("algorithms", "epsilons", "seeds", "upstreams"))
    if "epsilons" in ft:
        ft["epsilons"] = tuple(float(e) for e in ft["epsilons"])
    grid_keys = ("algorithms", "upstreams", "tasks", "epsilons", "seeds")
    ft["extra_grids"] = tuple(
        GridConfig(**_tuplify(g, grid_keys)) for g in ft.get("extra_grids", ())
    )
    ft["algo_params_for"] = tuple(
        ParamsFor(**_tuplify(e, ("upstreams", "tasks"))) for e in ft.get("algo_params_for", ())
    )
    pre = raw.get("pretrain", {})
    cfg = Config(
        data=_data(raw.get("data", {})),
        public=_split(raw["public"]),
        tasks={name: _split(t) for name, t in raw["tasks"].items()},
        model=ModelConfig(**raw.get("model", {})),
        warmup=SGDConfig(**_tuplify(raw.get("warmup", {}), ("milestones",))),
        upstreams=tuple(pre.get("methods", DEFAULT_METHODS)),
        upstream_params={k: dict(v) for k, v in pre.get("params", {}).items()},
        finetune=FinetuneConfig(**ft),
        privacy=PrivacyConfig(**raw.get("privacy", {})),
        robustness=RobustnessConfig(**raw.get("robustness", {})),
        tracking=TrackingConfig(**raw.get("tracking", {})),
        results_dir=raw.get("results_dir", "results"),
        seed=raw.get("seed", 0),
        device=raw.get("device", "auto"),
        tf32=raw.get("tf32", True),
        reference=_reference(raw.get("reference")),
        hpo=_hpo(raw.get("hpo", {})),
        federated=_federated(raw.get("federated", {}), tuple(pre.get("methods", DEFAULT_METHODS))),
        sweeps=SweepConfig(
            **_tuplify(raw.get("sweeps", {}), ("gammas", "methods", "tasks", "seeds"))
        ),
        audit=_audit(raw.get("audit", {})),
        external_upstreams={k: dict(v) for k, v in pre.get("external", {}).items()},
    )
    return cfg


def shown_path(path: str | Path) -> str:
    """`path` as a person typed it: relative to the working directory when it lies below it."""
    p = Path(os.path.normpath(Path(path).absolute()))  # configs/../config.yaml: config.yaml
    try:
        return str(p.relative_to(Path.cwd()))
    except ValueError:
        return str(p)


def key_lines(path: str | Path) -> dict[str, int]:
    """Line (1-based) of every key and list item of a YAML (or JSON) file, by dotted path.

    PyYAML, like Snakemake's loader, keeps the later of two equal keys without a word, so
    `epsilons:` written twice would run a grid nobody asked for: a key given twice in one
    mapping raises ConfigError naming both lines. Paths are spelt as the schema errors spell
    them (`finetune.extra_grids.0.algorithms`), so a problem can be pointed at its line.
    """
    p = Path(path)
    root = yaml.compose(p.read_text(), Loader=yaml.SafeLoader)
    lines: dict[str, int] = {}
    pending = [(root, "")]
    while pending:
        node, where = pending.pop()
        if isinstance(node, yaml.MappingNode):
            first: dict[str, int] = {}
            for key, value in node.value:
                name = str(key.value)
                here = f"{where}.{name}" if where else name
                line = key.start_mark.line + 1
                if name in first:
                    raise ConfigError(
                        f"invalid config:\n  {shown_path(p)}:{line}: {here}: duplicate key "
                        f"(first at line {first[name]}); YAML would keep only the later "
                        "value: delete one of the two"
                    )
                first[name] = lines[here] = line
                pending.append((value, here))
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                here = f"{where}.{i}" if where else str(i)
                lines[here] = item.start_mark.line + 1
                pending.append((item, here))
    return lines


# A problem line of a ConfigError: two spaces, a dotted key, ": " (see `_schema_message`).
_PROBLEM = re.compile(r"^  ([^\s:]+): ", re.M)


def _override_holds(overrides: dict[str, Any], key: str) -> bool:
    """Whether `key`'s value comes from `overrides` (Snakemake merges them in key by key)."""
    node: Any = overrides
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
        if not isinstance(node, dict):
            return True
    return True


def locate(
    exc: ConfigError, files: list[str | Path], overrides: dict[str, Any] | None = None
) -> ConfigError:
    """`exc` with each problem line prefixed by where its key is written: `file:line: key: ...`.

    `files` are merged in order (a later file wins), each with its chain of `base:` files
    (`key_origins`: the file of the chain the merged value comes from), so a key is pointed at
    the last file that writes the deepest part of its path; a key no file writes (a default the
    check refers to) at its nearest enclosing section. Keys set by `overrides` (Snakemake's
    `--config`) say so.
    """
    maps = []
    for f in files:
        # e.g. JSON indented with tabs; a broken chain was refused when it was read
        with contextlib.suppress(OSError, yaml.YAMLError, ConfigError):
            maps.append((shown_path(f), key_origins(f)))

    def where(match: re.Match) -> str:
        key = match.group(1)
        if overrides and _override_holds(overrides, key):
            return f"  --config: {key}: "
        best = key_origin(maps, key)
        if best is None:
            return f"  {maps[-1][0]}: {key}: " if maps else match.group(0)
        return f"  {best[1]}:{best[2]}: {key}: "

    return ConfigError(_PROBLEM.sub(where, str(exc)))


def key_origin(maps: list[tuple[str, dict]], key: str) -> tuple[int, str, int] | None:
    """(depth, file, line) of the deepest prefix of `key` that a file sets, the last file
    winning a tie (as the merge does); None when no file sets any of it."""
    parts = key.split(".")
    best: tuple[int, str, int] | None = None
    for _, origins in maps:
        for depth in range(len(parts), 0, -1):
            origin = origins.get(".".join(parts[:depth]))
            if origin is not None:
                if best is None or depth >= best[0]:
                    best = (depth, *origin)
                break
    return best


def _unique(path: Path, pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object, refused when it names a key twice (json keeps the later one silently)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ConfigError(f"invalid config:\n  {shown_path(path)}: {key}: duplicate key")
        out[key] = value
    return out


def _read_one(p: Path) -> dict[str, Any]:
    """One file as a plain mapping, `base:` and `unset:` still in it; duplicates refused."""
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    try:
        # JSON first: PyYAML reads JSON's 1e-05 as a string (YAML 1.1 floats need a dot).
        if p.suffix == ".json":
            raw = json.loads(p.read_text(), object_pairs_hook=functools.partial(_unique, p))
        else:
            key_lines(p)
            raw = yaml.safe_load(p.read_text()) or {}
    except (yaml.YAMLError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{p}: not valid YAML: {exc}") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"{p}: the config must be a mapping of sections")
    return raw


# Top-level keys of an overlay file, consumed while merging (the schema never sees them).
BASE_KEY = "base"
UNSET_KEY = "unset"


def _line(p: Path, key: str) -> str:
    """`file:line` of `key` in `p` (just `file` where the line cannot be had, e.g. JSON)."""
    with contextlib.suppress(OSError, yaml.YAMLError, ConfigError):
        line = key_lines(p).get(key)
        if line is not None:
            return f"{shown_path(p)}:{line}"
    return shown_path(p)


def config_chain(path: str | Path) -> list[Path]:
    """The files `path` is made of, its furthest `base:` first and `path` itself last.

    A base path is relative to the folder of the file that names it. A base that is missing,
    not a string, or that leads back to a file already in the chain is refused, naming the file
    and line of the `base:` key.
    """
    chain = [Path(path)]
    seen = [Path(path).resolve()]
    while True:
        here = chain[0]
        raw = _read_one(here)
        base = raw.get(BASE_KEY)
        if base is None:
            return chain
        where = _line(here, BASE_KEY)
        if not isinstance(base, str) or not base.strip():
            raise ConfigError(
                f"invalid config:\n  {where}: base: must be the path of another config file "
                f"(relative to {shown_path(here.parent)}/), not {base!r}"
            )
        target = here.parent / base
        if not target.is_file():
            raise ConfigError(
                f"invalid config:\n  {where}: base: {base!r} not found "
                f"(looked for {shown_path(target)})"
            )
        if target.resolve() in seen:
            names = " -> ".join(shown_path(f) for f in [*reversed(chain), target])
            raise ConfigError(f"invalid config:\n  {where}: base: cycle of config files: {names}")
        chain.insert(0, target)
        seen.append(target.resolve())


def uses_base(path: str | Path) -> bool:
    """Whether `path` is an overlay (has a top-level `base:` or `unset:`)."""
    return bool({BASE_KEY, UNSET_KEY} & set(_read_one(Path(path))))


def merge(base: dict[str, Any], overlay: dict[str, Any]) -> dict[str, Any]:
    """`overlay` on top of `base`: mappings merge key by key, anything else replaces.

    A list replaces the base's list whole, and a `null` is a value like any other (it sets the
    key to null; removing a key is `unset:`). Neither argument is changed; key order is the
    base's, with keys new in the overlay after it.
    """
    out = copy.deepcopy(base)
    for key, value in overlay.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _unset(raw: dict[str, Any], keys: Any, p: Path) -> dict[str, Any]:
    """`raw` without the dotted `keys` (an overlay's `unset:` list), each of which must exist."""
    where = _line(p, UNSET_KEY)
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise ConfigError(
            f"invalid config:\n  {where}: unset: must be a list of dotted keys of the base "
            "(e.g. [pretrain.params.sam])"
        )
    out = copy.deepcopy(raw)
    for key in keys:
        *parents, last = key.split(".")
        node: Any = out
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict) or last not in node:
            raise ConfigError(
                f"invalid config:\n  {where}: unset: {key!r} is not a key of the base config"
            )
        del node[last]
    return out


def read_chain(path: str | Path) -> dict[str, Any]:
    """The merged content of `path` and its chain of bases, without `base:` and `unset:`."""
    raw: dict[str, Any] = {}
    for p in config_chain(path):
        layer = _read_one(p)
        layer.pop(BASE_KEY, None)
        if UNSET_KEY in layer:
            raw = _unset(raw, layer.pop(UNSET_KEY), p)
        raw = merge(raw, layer)
    return raw


def read_raw(path: str | Path, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The config file as a plain mapping (not validated), with top-level `overrides` applied.

    A file with `base:` is merged onto its base first (`read_chain`). A key written twice in
    any file of the chain is refused (`key_lines`).
    """
    return {**read_chain(path), **(overrides or {})}


def read_files(files: list[str | Path], overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """What Snakemake's `config` is for `--configfile files... --config overrides`, bases merged.

    Snakemake merges its config files and `--config` recursively (mappings key by key), the
    same rule as `merge`; it does not know `base:`, so the workflow rebuilds its `config` with
    this when a file is an overlay (`workflow/rules/common.smk`).
    """
    raw: dict[str, Any] = {}
    for f in files:
        raw = merge(raw, read_chain(f))
    return merge(raw, dict(overrides or {}))


def _at(raw: Any, key: str) -> Any:
    """The value at dotted `key` of nested mappings, None where there is none."""
    for part in key.split("."):
        raw = raw.get(part) if isinstance(raw, dict) else None
    return raw


def key_origins(path: str | Path) -> dict[str, tuple[str, int]]:
    """(file, line) of every key of the merged config of `path`, by dotted path.

    The same rule as `merge`: a key the overlay writes as a mapping onto a mapping keeps the
    base's entries below it; anything else the overlay writes (a scalar, a list) drops them.
    """
    out: dict[str, tuple[str, int]] = {}
    merged: dict[str, Any] = {}
    for p in config_chain(path):
        name = shown_path(p)
        lines: dict[str, int] = {}
        with contextlib.suppress(yaml.YAMLError):  # e.g. JSON indented with tabs
            lines = key_lines(p)
        layer = _read_one(p)
        layer.pop(BASE_KEY, None)
        unset = layer.pop(UNSET_KEY, None)
        if unset is not None:
            merged = _unset(merged, unset, p)
            for key in unset:
                out = {k: v for k, v in out.items() if k != key and not k.startswith(key + ".")}
        replaced: list[str] = []
        for key in sorted(lines, key=lambda k: k.count(".")):
            if key.split(".")[0] in (BASE_KEY, UNSET_KEY):
                continue
            if not any(key.startswith(r + ".") for r in replaced) and not (
                isinstance(_at(layer, key), dict) and isinstance(_at(merged, key), dict)
            ):
                out = {k: v for k, v in out.items() if not k.startswith(key + ".")}
                replaced.append(key)
            out[key] = (name, lines[key])
        merged = merge(merged, layer)
    return out


MERGED_FILE = "config.merged.yaml"


def write_merged(raw: dict[str, Any], results_dir: str | Path, files: list[str | Path]) -> Path:
    """Write the effective config `raw` as `<results_dir>/config.merged.yaml` (atomically).

    An overlay names only what differs from its base; this file is the whole config the run
    used, after every `base:` and `--config`, so the results can be read (or rerun) without
    the chain of files. Written when a real run starts, never in a dry run.
    """
    out = Path(results_dir) / MERGED_FILE
    out.parent.mkdir(parents=True, exist_ok=True)
    plain = json.loads(json.dumps(raw, default=str))  # Snakemake's JSON loader: OrderedDicts
    sources = ", ".join(shown_path(f) for f in files) or "(none)"
    text = (
        f"# The effective config of {shown_path(results_dir)}/: {sources} with every base: "
        "merged in\n# and --config applied. Written by the workflow when a run starts; "
        "do not edit.\n" + yaml.safe_dump(plain, sort_keys=False, allow_unicode=True)
    )
    atomic.write_text(out, text)
    return out


def load(path: str | Path, overrides: dict[str, Any] | None = None) -> Config:
    """Schema-checked and parsed, without the registry checks (`dpadapter.validation.load`)."""
    raw = read_raw(path, overrides)
    try:
        return from_dict(raw)
    except ConfigError as exc:
        raise locate(exc, [path], overrides) from None
