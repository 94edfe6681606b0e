"""The whole config, composed from its sections (`Config`), parsed from a raw mapping
(`from_dict`) or read from a file (`load`).

The YAML is validated against `workflow/schemas/config.schema.yaml` first (so a bad key is
reported by name before any job starts); these dataclasses are what the code reads, so a
stage never digs into raw dicts and every default lives in one place. Each section checks
itself (`dpadapter.settings.sections`); checks that need the registries (names, per-method
params schemas, dataset sizes, privacy sanity) are each feature's own (`<feature>.checks`),
composed by `dpadapter.validation.compose`, which the workflow and the CLI call.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dpadapter.settings.audit import AuditConfig, parse_audit
from dpadapter.settings.errors import ConfigError
from dpadapter.settings.federated import FederatedConfig, parse_federated
from dpadapter.settings.files import read_raw
from dpadapter.settings.grid import grid, union
from dpadapter.settings.hpo import HPOConfig, parse_hpo
from dpadapter.settings.lines import locate
from dpadapter.settings.reference import ReferenceConfig, parse_reference
from dpadapter.settings.schema import validate_raw
from dpadapter.settings.sections import (
    DataConfig,
    FinetuneConfig,
    GridConfig,
    ModelConfig,
    ParamsFor,
    PrivacyConfig,
    RobustnessConfig,
    SGDConfig,
    SplitConfig,
    SweepConfig,
    TrackingConfig,
    tuplify,
)


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
    device: str = (
        "auto"  # auto | cpu | cuda[:i]; $DPADAPTER_DEVICE overrides (dpadapter.ground.device)
    )
    tf32: bool = True  # TF32 matmuls/convolutions on CUDA
    reference: ReferenceConfig | None = None  # a published table shown beside ours
    hpo: HPOConfig = field(default_factory=HPOConfig)
    federated: FederatedConfig = field(default_factory=FederatedConfig)
    sweeps: SweepConfig = field(default_factory=SweepConfig)
    audit: AuditConfig = field(default_factory=AuditConfig)
    # `pretrain.external`: label -> params of the `external` method (dpadapter.upstream.resolve)
    external_upstreams: dict[str, dict[str, Any]] = field(default_factory=dict)
    # `pretrain.processes`: processes (GPUs) of a warm-up or pre-training job; > 1 runs it under
    # torchrun, each rank on its rows of every batch (dpadapter.train.loops.mean_loss_backward)
    pretrain_processes: int = 1

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def grid_tasks(self) -> tuple[str, ...]:
        """Tasks the fine-tuning grids use by default: every task not marked `grids: false`."""
        return tuple(n for n, t in self.tasks.items() if t.grids)

    def grid_algorithms(self) -> tuple[str, ...]:
        """The fine-tuning grids' algorithms in the order the config names them, main grid
        first: the order of the table's algorithm blocks, as the paper's table lists them."""
        return tuple(dict.fromkeys(job[2] for job in self.finetune_grid()))

    def finetune_grid(self) -> list[tuple[str, str, str, float, int, str]]:
        """Every (upstream, task, algorithm, epsilon, seed, strategy) job, main grid first, no
        duplicates; `finetune.folder(algorithm, strategy)` is its algorithm folder."""
        ft = self.finetune
        main = GridConfig(ft.algorithms, upstreams=ft.upstreams, strategies=ft.grid_strategies())
        grids = [main, *ft.extra_grids]
        return union(
            *(
                grid(
                    g.upstreams or self.upstreams,
                    g.tasks or self.grid_tasks(),
                    g.algorithms,
                    [float(e) for e in g.epsilons or ft.epsilons],
                    [int(s) for s in g.seeds or ft.seeds],
                    g.strategies or ft.grid_strategies(),
                )
                for g in grids
            )
        )


def _split(d: dict[str, Any]) -> SplitConfig:
    return SplitConfig(**tuplify(d, ("classes",)))


def _data(raw: dict[str, Any]) -> DataConfig:
    d = dict(raw)
    norm = d.pop("normalization", None)
    if norm is not None:
        norm = (tuple(float(v) for v in norm["mean"]), tuple(float(v) for v in norm["std"]))
    return DataConfig(**d, normalization=norm)


# `pretrain.methods` when a config names none.
DEFAULT_METHODS = ("scratch", "standard")


def from_dict(raw: dict[str, Any], validate: bool = True) -> Config:
    if validate:
        validate_raw(raw)
    ft = dict(raw.get("finetune", {}))
    ft = tuplify(ft, ("algorithms", "epsilons", "seeds", "upstreams", "strategies"))
    if "epsilons" in ft:
        ft["epsilons"] = tuple(float(e) for e in ft["epsilons"])
    grid_keys = ("algorithms", "upstreams", "tasks", "epsilons", "seeds", "strategies")
    ft["extra_grids"] = tuple(
        GridConfig(**tuplify(g, grid_keys)) for g in ft.get("extra_grids", ())
    )
    ft["algo_params_for"] = tuple(
        ParamsFor(**tuplify(e, ("upstreams", "tasks"))) for e in ft.get("algo_params_for", ())
    )
    pre = raw.get("pretrain", {})
    methods = tuple(pre.get("methods", DEFAULT_METHODS))
    cfg = Config(
        data=_data(raw.get("data", {})),
        public=_split(raw["public"]),
        tasks={name: _split(t) for name, t in raw["tasks"].items()},
        model=ModelConfig(**raw.get("model", {})),
        warmup=SGDConfig(**tuplify(raw.get("warmup", {}), ("milestones",))),
        upstreams=methods,
        upstream_params={k: dict(v) for k, v in pre.get("params", {}).items()},
        finetune=FinetuneConfig(**ft),
        privacy=PrivacyConfig(**raw.get("privacy", {})),
        robustness=RobustnessConfig(**raw.get("robustness", {})),
        tracking=TrackingConfig(**raw.get("tracking", {})),
        results_dir=raw.get("results_dir", "results"),
        seed=raw.get("seed", 0),
        device=raw.get("device", "auto"),
        tf32=raw.get("tf32", True),
        reference=parse_reference(raw.get("reference")),
        hpo=parse_hpo(raw.get("hpo", {})),
        federated=parse_federated(raw.get("federated", {}), methods),
        sweeps=SweepConfig(
            **tuplify(raw.get("sweeps", {}), ("gammas", "methods", "tasks", "seeds"))
        ),
        audit=parse_audit(raw.get("audit", {})),
        external_upstreams={k: dict(v) for k, v in pre.get("external", {}).items()},
        pretrain_processes=int(pre.get("processes", 1)),
    )
    return cfg


def load(path: str | Path, overrides: dict[str, Any] | None = None) -> Config:
    """Schema-checked and parsed, without the registry checks
    (`dpadapter.validation.compose.load`)."""
    raw = read_raw(path, overrides)
    try:
        return from_dict(raw)
    except ConfigError as exc:
        raise locate(exc, [path], overrides) from None
