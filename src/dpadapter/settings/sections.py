"""The main grid's sections of `config.yaml`: typed, frozen, each checking itself.

What a section can tell about itself alone is checked where it is built, in `__post_init__`
(the pattern of jax_privacy's `training/algorithm_config.py`), or listed by its `problems()` as
`key: text` lines where a problem must wait for the target that runs the section
(`dpadapter.settings.problems.blocking`). What needs the registries or another section is checked
by the
feature that owns it (`dpadapter.<feature>.checks`), composed by `dpadapter.validation.compose`.
The feature sections (HPO, federated, audit, reference) are in their own modules beside this.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from dpadapter.settings.errors import ConfigError


def tuplify(d: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    """`d` with the lists at `keys` made tuples (frozen sections hold no lists)."""
    out = dict(d)
    for k in keys:
        if k in out and out[k] is not None:
            out[k] = tuple(out[k])
    return out


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
    # Convert the images to this many channels (null: as the source): 3 replicates a grey
    # image (Pretrain-DPFL's Fashion-MNIST as 3x32x32), 1 makes a colour one grey (luminance).
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

    def __post_init__(self) -> None:
        norm = self.normalization
        if norm is not None and len(norm[0]) != len(norm[1]):
            raise ConfigError(
                f"data.normalization: {len(norm[0])} mean(s) but {len(norm[1])} std(s)"
            )


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
    strategies: tuple[str, ...] = ()


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
    # itself (GEP, the federated clients) runs Opacus' hooks under bk (per_sample)
    grad_sample_mode: str = "bk"
    # autocast of the DP step (per_sample.precision): fp32 (none), bf16, fp16 (loss scale)
    precision: str = "fp32"
    # the per-sample self-test at wrap time (dpadapter.per_sample.self_test)
    per_sample_check: bool = True
    physical_batch_size: int | None = None
    # pad physical batches (and federated clients' samples) to one shape: auto = on CUDA and
    # when compiling
    pad_batches: bool | str = "auto"
    # How the Poisson rate q follows from batch_size (dpadapter.train.dp_spec.sample_rate):
    # "batch_size": q = batch_size / n; "loader": q = 1 / ceil(n / batch_size), what Opacus'
    # make_private gives a DataLoader(batch_size) (the DP-SAT paper's code).
    sample_rate_from: str = "batch_size"
    extra_grids: tuple[GridConfig, ...] = ()
    algo_params: dict[str, dict[str, Any]] = field(default_factory=dict)
    algo_params_for: tuple[ParamsFor, ...] = ()
    # Per-algorithm recipe: RECIPE_KEYS of this section that an algorithm's jobs take instead
    # (each algorithm tuned on the public proxy as DP-SGD's recipe was: dpadapter.hpo.recipe)
    recipes: dict[str, dict[str, Any]] = field(default_factory=dict)
    strategy: str = "ft"  # dpadapter.train.strategies: ft (all), ht (head), ut (HT, FT), bitfit
    # the tuning strategies of the main grid, an axis like epsilons (empty = `strategy` alone);
    # `strategy`'s jobs keep the plain algorithm folder, the others' are `<algo>+<strategy>`
    strategies: tuple[str, ...] = ()
    ut_t1_fraction: float = 0.5  # ut: share of the steps that are head-tuning
    # frozen BatchNorms' scale and shift under DP: train (per example) | freeze (models.batchnorm)
    bn_affine: str = "train"
    # processes (GPUs) per fine-tuning job: > 1 runs it under torchrun, data-parallel, with one
    # Poisson sample, one clipped sum and one noise draw per step (dpadapter.ground.distributed)
    processes: int = 1
    # torch.compile of bk's forward and backward (per_sample.compiled): off, or torch.compile's
    # mode (reduce-overhead: CUDA graphs); batches are then padded to one shape
    compile: str = "off"

    def __post_init__(self) -> None:
        if self.compile is False:  # YAML reads a bare `off` as false
            object.__setattr__(self, "compile", "off")

    def problems(self) -> list[str]:
        """What the section gets wrong on its own (`key: text`)."""
        out = []
        if self.optimizer == "adam" and self.momentum:
            out.append(
                "finetune.momentum: adam has no momentum setting (its betas are torch's "
                "defaults); set momentum: 0 or optimizer: sgd"
            )
        if self.compile != "off" and self.grad_sample_mode != "bk":
            out.append(
                f"finetune.compile: {self.compile!r} compiles book-keeping only; set "
                f"grad_sample_mode: bk or compile: off (not {self.grad_sample_mode!r})"
            )
        if self.compile != "off" and self.pad_batches is False:
            out.append(
                "finetune.compile: a compiled step is compiled once per batch shape, and "
                "unpadded Poisson batches have a new size at most steps; set pad_batches: auto "
                "(padded when compiling) or true, or compile: off"
            )
        return out

    def grid_strategies(self) -> tuple[str, ...]:
        """The main grid's strategies: `strategies`, else the one `strategy`."""
        return self.strategies or (self.strategy,)

    def folder(self, algo: str, strategy: str) -> str:
        """A job's algorithm folder: `algo` for `strategy`, `algo+<strategy>` for the others,
        so adding a strategy to a grid moves no finished job (`split_folder` reads it back)."""
        return join_folder(algo, None if strategy == self.strategy else strategy)

    def for_algorithm(self, algo: str) -> FinetuneConfig:
        """This section as `algo`'s jobs train with it: its `recipes` entry in place of the
        shared recipe (the section itself for an algorithm without one)."""
        own = self.recipes.get(algo)
        return replace(self, **own) if own else self

    def params_of(
        self, algo: str, upstream: str | None = None, task: str | None = None
    ) -> dict[str, Any]:
        """`algo`'s params for a job on (upstream, task): `algo_params`, then the overrides."""
        out = dict(self.algo_params.get(algo, {}))
        for entry in self.algo_params_for:
            if entry.applies(upstream, task):
                out.update(entry.algo_params.get(algo, {}))
        return out


# The fine-tuning recipe: the keys of `finetune` a recipe search chooses (dpadapter.hpo.recipe)
# and `finetune.recipes` may set per algorithm.
RECIPE_KEYS = ("batch_size", "epochs", "lr", "momentum", "max_grad_norm")

# Between an algorithm and a tuning strategy in a fine-tuning job's folder (`dpsgd+ht`).
STRATEGY_SEP = "+"


def join_folder(algo: str, strategy: str | None) -> str:
    """A job's algorithm folder: `algo`, or `algo+strategy` (None: finetune.strategy's job)."""
    return algo if strategy is None else f"{algo}{STRATEGY_SEP}{strategy}"


def split_folder(folder: str) -> tuple[str, str | None]:
    """(algorithm, strategy) of a job folder; None: the config's `finetune.strategy`."""
    algo, sep, strategy = folder.partition(STRATEGY_SEP)
    return algo, (strategy if sep else None)


@dataclass(frozen=True)
class TrackingConfig:
    uri: str | None = None
    experiment: str = "dpadapter"
    # "auto": on where mlflow imports and the store answers, else the job runs untracked and
    # says so once; True: either missing is an error before training; False: mlflow unused.
    enabled: bool | str = "auto"
    # MLflow's system metrics on a training job's run (CPU and GPU utilisation, memory, over
    # time): "auto" on jobs that run on CUDA, where a starved GPU is what to see; True: every job
    system_metrics: bool | str = "auto"


@dataclass(frozen=True)
class SweepConfig:
    """The paper's gamma sweeps (Figs. 5 and 6): upstream methods at several radii."""

    gammas: tuple[float, ...] = (0.1, 0.5, 1.0, 2.0)
    methods: tuple[str, ...] = ("sam", "dpadapter")
    tasks: tuple[str, ...] = ()
    algorithm: str = "dpsgd"
    epsilon: float = 1.0
    seeds: tuple[int, ...] = (0,)
