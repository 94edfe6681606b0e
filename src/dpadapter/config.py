"""Typed, frozen views of `config.yaml`.

The YAML is validated against `workflow/schemas/config.schema.yaml` first (so a bad key is
reported by name before any job starts); these dataclasses are what the code reads, so a
stage never digs into raw dicts and every default lives in one place.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

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


@dataclass(frozen=True)
class DataConfig:
    root: str = "data"
    download: bool = False
    split_seed: int = 0
    image_size: int | None = None


@dataclass(frozen=True)
class ModelConfig:
    name: str = "cnn-gn"
    groups: int = 8
    width: int = 16


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


@dataclass(frozen=True)
class RobustnessConfig:
    noise_std: float = 0.1
    draws: int = 3
    seed: int = 1234


@dataclass(frozen=True)
class PrivacyConfig:
    delta: float = 1e-5
    accountant: str = "prv"


@dataclass(frozen=True)
class GridConfig:
    """A sub-grid of fine-tuning jobs; empty fields mean 'as in the main grid'."""

    algorithms: tuple[str, ...]
    upstreams: tuple[str, ...] = ()
    tasks: tuple[str, ...] = ()
    epsilons: tuple[float, ...] = ()
    seeds: tuple[int, ...] = ()


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
    max_grad_norm: float = 1.0
    grad_sample_mode: str = "ew"
    physical_batch_size: int | None = None
    extra_grids: tuple[GridConfig, ...] = ()
    algo_params: dict[str, dict[str, Any]] = field(default_factory=dict)
    strategy: str = "ft"  # dpadapter.strategies: ft (all params), ht (head only), ut (HT, FT)
    ut_t1_fraction: float = 0.5  # ut: share of the steps that are head-tuning


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
    estimate_clip: float | None = None  # l2 bound inside the estimates; None = max_grad_norm


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

    Grid: each pre-trained upstream x {ht, ft, ut}, plus `scratch` (FT from the random-init
    checkpoint), x mechanism x its epsilons x seeds, at `rounds` rounds; `rounds_sweep` adds
    the same strategies at other round counts, at `sweep_epsilons[mechanism]`. `ut_t1` is
    "rule" (Theorems 2-3 from privately estimated constants; the mechanism's
    `estimate_fraction` of the budget pays for the estimate) or a fraction of the rounds.
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
    hpo: HPOConfig = field(default_factory=HPOConfig)
    federated: FederatedConfig = field(default_factory=FederatedConfig)
    sweeps: SweepConfig = field(default_factory=SweepConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def finetune_grid(self) -> list[tuple[str, str, str, float, int]]:
        """Every (upstream, task, algorithm, epsilon, seed) job, main grid first, no duplicates."""
        ft = self.finetune
        grids = [GridConfig(ft.algorithms, upstreams=ft.upstreams)] + list(ft.extra_grids)
        jobs: dict[tuple, None] = {}
        for g in grids:
            for u in g.upstreams or self.upstreams:
                for t in g.tasks or tuple(self.tasks):
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
    keys += ("lr_range", "steps_range")
    out = _tuplify(d, keys)
    if "sweep_epsilons" in out:
        out["sweep_epsilons"] = tuple(float(e) for e in out["sweep_epsilons"])
    return HPOConfig(**out)


def _federated(d: dict[str, Any]) -> FederatedConfig:
    keys = ("upstreams", "strategies", "mechanisms", "seeds", "rounds_sweep", "sweep_seeds")
    out = _tuplify(d, keys)
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


def validate_raw(raw: dict[str, Any]) -> None:
    """Check the raw mapping against the JSON schema; raise ConfigError naming the bad key."""
    import jsonschema

    schema = yaml.safe_load(SCHEMA_PATH.read_text())
    validator = jsonschema.Draft202012Validator(schema)
    errors = sorted(validator.iter_errors(raw), key=lambda e: list(e.absolute_path))
    if errors:
        lines = []
        for err in errors:
            where = ".".join(str(p) for p in err.absolute_path) or "<top level>"
            lines.append(f"  {where}: {err.message}")
        raise ConfigError("invalid config:\n" + "\n".join(lines))


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
    pre = raw.get("pretrain", {})
    cfg = Config(
        data=DataConfig(**raw.get("data", {})),
        public=_split(raw["public"]),
        tasks={name: _split(t) for name, t in raw["tasks"].items()},
        model=ModelConfig(**raw.get("model", {})),
        warmup=SGDConfig(**_tuplify(raw.get("warmup", {}), ("milestones",))),
        upstreams=tuple(pre.get("methods", ("scratch", "standard"))),
        upstream_params={k: dict(v) for k, v in pre.get("params", {}).items()},
        finetune=FinetuneConfig(**ft),
        privacy=PrivacyConfig(**raw.get("privacy", {})),
        robustness=RobustnessConfig(**raw.get("robustness", {})),
        tracking=TrackingConfig(**raw.get("tracking", {})),
        results_dir=raw.get("results_dir", "results"),
        seed=raw.get("seed", 0),
        hpo=_hpo(raw.get("hpo", {})),
        federated=_federated(raw.get("federated", {})),
        sweeps=SweepConfig(
            **_tuplify(raw.get("sweeps", {}), ("gammas", "methods", "tasks", "seeds"))
        ),
    )
    check_semantics(cfg)
    return cfg


def check_semantics(cfg: Config) -> None:
    """Cross-field checks the schema cannot express; names resolved against the registries."""
    from dpadapter.algorithms import ALGORITHMS
    from dpadapter.data import DATASETS
    from dpadapter.models import MODEL_NAMES
    from dpadapter.upstream import UPSTREAMS

    problems = []
    for where, split in [("public", cfg.public)] + [
        (f"tasks.{n}", t) for n, t in cfg.tasks.items()
    ]:
        if split.dataset not in DATASETS:
            problems.append(
                f"{where}.dataset: unknown dataset {split.dataset!r}; known: {sorted(DATASETS)}"
            )
    for name in cfg.finetune.algorithms:
        if name not in ALGORITHMS:
            problems.append(
                f"finetune.algorithms: unknown algorithm {name!r}; known: {sorted(ALGORITHMS)}"
            )
    for name in cfg.upstreams:
        if name not in UPSTREAMS:
            problems.append(
                f"pretrain.methods: unknown upstream method {name!r}; known: {sorted(UPSTREAMS)}"
            )
    for name in cfg.upstream_params:
        if name not in UPSTREAMS:
            problems.append(f"pretrain.params: unknown upstream method {name!r}")
    for name in cfg.finetune.upstreams:
        if name not in cfg.upstreams:
            problems.append(f"finetune.upstreams: {name!r} is not in pretrain.methods")
    for i, g in enumerate(cfg.finetune.extra_grids):
        where = f"finetune.extra_grids.{i}"
        for name in g.algorithms:
            if name not in ALGORITHMS:
                problems.append(f"{where}.algorithms: unknown algorithm {name!r}")
        for name in g.upstreams:
            if name not in cfg.upstreams:
                problems.append(f"{where}.upstreams: {name!r} is not in pretrain.methods")
        for name in g.tasks:
            if name not in cfg.tasks:
                problems.append(f"{where}.tasks: unknown task {name!r}")
    for name in cfg.finetune.algo_params:
        if name not in ALGORITHMS:
            problems.append(f"finetune.algo_params: unknown algorithm {name!r}")
    if not cfg.model.name.startswith("timm:") and cfg.model.name not in MODEL_NAMES:
        problems.append(
            f"model.name: unknown model {cfg.model.name!r}; "
            f"known: {sorted(MODEL_NAMES)} or 'timm:<name>'"
        )
    if not 0 < cfg.privacy.delta < 1:
        problems.append("privacy.delta: must be in (0, 1)")
    for name in cfg.sweeps.methods:
        if name not in UPSTREAMS:
            problems.append(f"sweeps.methods: unknown upstream method {name!r}")
    for name in cfg.sweeps.tasks:
        if name not in cfg.tasks:
            problems.append(f"sweeps.tasks: unknown task {name!r}")
    if cfg.sweeps.algorithm not in ALGORITHMS:
        problems.append(f"sweeps.algorithm: unknown algorithm {cfg.sweeps.algorithm!r}")
    problems += _hpo_problems(cfg, set(ALGORITHMS))
    problems += _federated_problems(cfg)
    if problems:
        raise ConfigError("invalid config:\n" + "\n".join(f"  {p}" for p in problems))


def _hpo_problems(cfg: Config, algorithms: set[str]) -> list[str]:
    """Cross-field checks of the `hpo` section (names, ranges, and a budget the trials fit in)."""
    h, out = cfg.hpo, []
    for name in h.upstreams:
        if name not in cfg.upstreams:
            out.append(f"hpo.upstreams: {name!r} is not in pretrain.methods")
    for name in h.tasks:
        if name not in cfg.tasks:
            out.append(f"hpo.tasks: unknown task {name!r}")
    for name in h.algorithms:
        if name not in algorithms:
            out.append(f"hpo.algorithms: unknown algorithm {name!r}; known: {sorted(algorithms)}")
    eps = list(h.sweep_epsilons)
    if eps != sorted(set(eps)):
        out.append("hpo.sweep_epsilons: must be strictly increasing")
    if eps and eps[-1] >= h.target_epsilon:
        out.append("hpo.sweep_epsilons: every sweep budget must be below hpo.target_epsilon")
    need = {"linear": 2, "quadratic": 3}.get(h.fit, 2)
    if len(eps) < need:
        out.append(f"hpo.sweep_epsilons: a {h.fit} fit needs at least {need} sweep budgets")
    if not 0 < h.lr_range[0] <= h.lr_range[1]:
        out.append("hpo.lr_range: must be [min, max] with 0 < min <= max")
    if not 1 <= h.steps_range[0] <= h.steps_range[1]:
        out.append("hpo.steps_range: must be [min, max] with 1 <= min <= max")
    return out


def _federated_problems(cfg: Config) -> list[str]:
    """Cross-field checks of the `federated` section (names resolved against the config)."""
    f, out = cfg.federated, []
    if f.task is not None and f.task not in cfg.tasks:
        out.append(f"federated.task: unknown task {f.task!r}; known: {sorted(cfg.tasks)}")
    for name in f.upstreams:
        if name not in cfg.upstreams:
            out.append(f"federated.upstreams: {name!r} is not in pretrain.methods")
    if "scratch" in f.strategies and "scratch" not in cfg.upstreams:
        out.append("federated.strategies: 'scratch' needs 'scratch' in pretrain.methods")
    if any(s != "scratch" for s in f.strategies) and not f.pretrained(cfg.upstreams):
        out.append("federated.upstreams: no pre-trained upstream for ht/ft/ut")
    missing = [m for m in f.mechanisms if m not in f.sweep_epsilons] if f.rounds_sweep else []
    for m in missing:
        out.append(f"federated.sweep_epsilons: rounds_sweep needs an epsilon for {m!r}")
    if f.laplace.sample_rate != 1.0:
        out.append("federated.laplace.sample_rate: must be 1 (Theorem 1 uses every example)")
    if isinstance(f.ut_t1, str) and f.ut_t1 != "rule":
        out.append("federated.ut_t1: 'rule' or a fraction in [0, 1]")
    return out


def load(path: str | Path, overrides: dict[str, Any] | None = None) -> Config:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    try:
        # JSON first: PyYAML reads JSON's 1e-05 as a string (YAML 1.1 floats need a dot).
        raw = (
            json.loads(p.read_text())
            if p.suffix == ".json"
            else (yaml.safe_load(p.read_text()) or {})
        )
    except (yaml.YAMLError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{p}: not valid YAML: {exc}") from exc
    if overrides:
        raw = {**raw, **overrides}
    return from_dict(raw)
