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
    batch_size: int = 200
    epochs: int = 10
    lr: float = 0.5
    momentum: float = 0.0
    max_grad_norm: float = 1.0
    grad_sample_mode: str = "ew"
    physical_batch_size: int | None = None
    extra_grids: tuple[GridConfig, ...] = ()
    algo_params: dict[str, dict[str, Any]] = field(default_factory=dict)


@dataclass(frozen=True)
class TrackingConfig:
    uri: str | None = None
    experiment: str = "dpadapter"


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

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def finetune_grid(self) -> list[tuple[str, str, str, float, int]]:
        """Every (upstream, task, algorithm, epsilon, seed) job, main grid first, no duplicates."""
        ft = self.finetune
        grids = [GridConfig(ft.algorithms)] + list(ft.extra_grids)
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
    ft = _tuplify(ft, ("algorithms", "epsilons", "seeds"))
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
    if problems:
        raise ConfigError("invalid config:\n" + "\n".join(f"  {p}" for p in problems))


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
