"""Every check of a config that needs the registries, in one place, before any job starts.

`dpadapter.config` holds the dataclasses, the JSON schema check and the parsing, and imports no
registry (the registries import its dataclasses). This module sits above both: it plugs each
registered method's and algorithm's `params_schema` into the config schema, resolves names
against the registries, checks the data a config asks for against the dataset registry's
declared sizes (no data is loaded), and refuses privacy parameters that make no sense. The
workflow (`workflow/rules/common.smk`) and the CLI (`python -m dpadapter`) call `validate` /
`load`; every message names the full key.

The workflow validates while Snakemake parses, so this module imports no torch, Opacus or
MLflow: the registries are read through `dpadapter.catalog` (names, params schemas, flags).
Only a config naming an external backbone imports its method (timm's pretrained_cfg, the
weights' location), in `_external_problems` and `weight_problems`.
"""

from __future__ import annotations

import copy
import functools
import itertools
from pathlib import Path
from typing import Any

from dpadapter import catalog
from dpadapter.config import (
    Config,
    ConfigError,
    SplitConfig,
    base_schema,
    config_chain,
    key_lines,
    read_raw,
    validate_raw,
)
from dpadapter.config import from_dict as _parse
from dpadapter.data import DATASET_INFO, family_of, missing_files, resolve_dataset
from dpadapter.param_schema import param_errors
from dpadapter.privacy import max_reachable_epsilon
from dpadapter.privacy.calibration import SIGMA_MIN
from dpadapter.problems import blocking, error, locate
from dpadapter.upstream.resolve import EXTERNAL, known_names, resolve
from dpadapter.upstream.variants import format_variant, parse_variant

__all__ = [
    "ConfigError",
    "full_schema",
    "load",
    "validate",
    "validate_files",
    "variant_problems",
]

# Subsets of roles drawn from one source whose joint demand is checked (2^k of them).
_MAX_ROLES_FOR_SUBSETS = 10


def full_schema() -> dict[str, Any]:
    """The config schema with every registered method's and algorithm's params schema in it."""
    return copy.deepcopy(_full_schema())


@functools.cache
def _full_schema() -> dict[str, Any]:  # parsing the schema's YAML costs 0.1 s; once a process
    schema = base_schema()
    props = schema["properties"]

    def plug(section: dict[str, Any], key: str, registry: dict[str, Any], what: str) -> None:
        section["properties"][key] = {
            "type": "object",
            "description": f"per-{what} hyperparameters, keyed by registry name",
            "additionalProperties": False,
            "properties": {name: e.params_schema for name, e in registry.items()},
        }

    upstreams, algorithms = catalog.upstreams(), catalog.algorithms()
    plug(props["pretrain"], "params", upstreams, "method")
    props["pretrain"]["properties"]["external"]["additionalProperties"] = upstreams[
        EXTERNAL
    ].params_schema
    plug(props["finetune"], "algo_params", algorithms, "algorithm")
    plug(
        props["finetune"]["properties"]["algo_params_for"]["items"],
        "algo_params",
        algorithms,
        "algorithm",
    )
    return schema


def validate(
    raw: dict[str, Any], check_files: bool = False, sections: tuple[str, ...] | None = None
) -> Config:
    """Schema (with the registries' params schemas), parsing, then every cross-field check.

    `check_files` also looks for each dataset's files (the workflow does; a job's CLI does not,
    as its loader reports missing files itself). `sections`: the optional sections whose
    problems count (`dpadapter.problems.blocking`; None: all of them).
    """
    cfg, problems = check(raw, check_files)
    problems = blocking(problems, sections)
    if problems:
        raise error(problems)
    return cfg


def check(raw: dict[str, Any], check_files: bool = False) -> tuple[Config, list[str]]:
    """The parsed config and every cross-field problem (`key: text`); schema errors raise."""
    raw = copy.deepcopy(raw)
    validate_raw(raw, _full_schema())
    cfg = _parse(raw, validate=False)
    problems = _dataset_family_problems(cfg, check_files)
    problems += _name_problems(cfg)
    problems += _external_problems(cfg)
    problems += _hpo_problems(cfg)
    problems += _federated_problems(cfg)
    problems += _data_problems(cfg)
    problems += _privacy_problems(cfg)
    problems += _reference_problems(cfg)
    problems += _audit_problems(cfg)
    if check_files:
        problems += file_problems(cfg)
        problems += weight_problems(cfg)
    if not blocking(problems, ()):  # the backbone is built (on the meta device) only from a
        problems += _backbone_problems(cfg, check_files)  # main grid without problems
    return cfg, problems


def load(
    path: str | Path,
    overrides: dict[str, Any] | None = None,
    check_files: bool = False,
    sections: tuple[str, ...] | None = None,
) -> Config:
    return validate_files(read_raw(path, overrides), [path], overrides, check_files, sections)


def check_files_of(
    raw: dict[str, Any],
    files: list[str | Path],
    overrides: dict[str, Any] | None,
    check_files: bool,
) -> tuple[Config, list[str]]:
    """`check` of `raw` after its files' duplicate keys are refused (an overlay's bases too);
    a schema error is pointed at its file and line. The shared first half of `validate_files`
    and `dpadapter.sections.validate_scoped`."""
    for f in files:
        if Path(f).is_file():
            for part in config_chain(f):
                if part.suffix != ".json":
                    key_lines(part)
    try:
        return check(raw, check_files)
    except ConfigError as exc:
        raise locate(exc, files, overrides) from None


def validate_files(
    raw: dict[str, Any],
    files: list[str | Path],
    overrides: dict[str, Any] | None = None,
    check_files: bool = False,
    sections: tuple[str, ...] | None = None,
) -> Config:
    """`validate` for `raw` merged from `files` (and `overrides`), each problem pointed at the
    file and line where its fix belongs (`dpadapter.problems.locate`).

    Each file (and each `base:` it builds on) is read again for its key lines: whoever loaded
    `raw` (Snakemake's `--configfile` loader, PyYAML) kept the later of two equal keys silently,
    so a duplicate is refused here, naming both lines; every other problem gets `file:line:` of
    the key it names.
    """
    cfg, problems = check_files_of(raw, files, overrides, check_files)
    problems = blocking(problems, sections)
    if problems:
        own = functools.partial(check, check_files=check_files)  # the base's own problems
        raise locate(error(problems), files, overrides, own=own, defaults=cfg.to_dict())
    return cfg


def variant_problems(
    name: str,
    params: dict[str, dict[str, Any]],
    where: str,
    external: dict[str, dict[str, Any]] | None = None,
) -> list[str]:
    """Problems of an upstream name `method[+param=value]...` against the method's schema.

    The variant's params are the config's `pretrain.params.<method>` (or `pretrain.external.
    <label>`) with the overrides on top, which is what the pretrain job will construct the
    method with (`dpadapter.upstream.resolve`).
    """
    try:
        entry, merged, at = resolve(name, params, external)
    except (KeyError, ValueError) as exc:
        return [f"{where}: {exc.args[0]}"]
    if not parse_variant(name)[1]:
        return []
    return [
        f"{where}: upstream variant {name!r}: {p}"
        for p in param_errors(entry.params_schema, merged, at)
    ]


def weight_problems(cfg: Config) -> list[str]:
    """Each external upstream whose weights are not on this machine, with the fetch command."""
    out = []
    for name in dict.fromkeys(cfg.upstreams):
        try:
            entry, params, at = resolve(name, cfg.upstream_params, cfg.external_upstreams)
        except (KeyError, ValueError):
            continue  # reported by _name_problems
        if entry.name != EXTERNAL or "weights" not in params:
            continue
        from dpadapter.upstream.external import WeightsUnavailable, locate_weights

        try:
            locate_weights(params)
        except WeightsUnavailable as exc:
            out.append(f"{at}.weights: {exc}")
    return out


def file_problems(cfg: Config) -> list[str]:
    """Each dataset whose files the loader will not find, with the loader's own message."""
    out = []
    seen: set[str] = set()
    for where, split in _roles(cfg):
        if split.dataset in seen or split.dataset not in DATASET_INFO:
            continue
        seen.add(split.dataset)
        msg = missing_files(split.dataset, cfg.data.root, cfg.data.download)
        if msg:
            out.append(f"{where}.dataset: {msg}")
    return out


# --- names ---------------------------------------------------------------------------------


def _dataset_family_problems(cfg: Config, check_files: bool) -> list[str]:
    """Datasets named `<family>:<spec>` (imagefolder:<path>@<side>) are registered from what
    `data.root` holds now (their class counts), or reported with the path they lack (only
    with `check_files`, as any dataset's files: without, their counts go unchecked)."""
    out, seen = [], set()
    for where, split in _roles(cfg):
        if split.dataset not in seen:
            seen.add(split.dataset)
            problem = resolve_dataset(
                split.dataset, cfg.data.root, missing_ok=not check_files, fresh=True
            )
            if problem:
                out.append(f"{where}.dataset: {problem}")
    return out


def _roles(cfg: Config) -> list[tuple[str, SplitConfig]]:
    return [("public", cfg.public)] + [(f"tasks.{n}", t) for n, t in cfg.tasks.items()]


NOT_METHOD = "{} is not in pretrain.methods"


def _registries() -> tuple[dict, dict, dict]:
    """The catalog's algorithms, upstream methods and models, by name."""
    return catalog.algorithms(), catalog.upstreams(), catalog.models()


def _missing(where: str, names, known, message: str) -> list[str]:
    """`where: message` (the name quoted into its `{}`) for each name that is not in `known`."""
    return [f"{where}: {message.format(repr(n))}" for n in names if n not in known]


def _name_problems(cfg: Config) -> list[str]:
    """Names resolved against the registries and the config's own lists."""
    problems = []
    algos, methods, models = _registries()
    for where, split in _roles(cfg):
        if split.dataset not in DATASET_INFO and family_of(split.dataset) is None:
            problems.append(
                f"{where}.dataset: unknown dataset {split.dataset!r}; known: {sorted(DATASET_INFO)}"
            )
    for name in cfg.finetune.algorithms:
        if name not in algos:
            problems.append(
                f"finetune.algorithms: unknown algorithm {name!r}; known: {sorted(algos)}"
            )
    for name in cfg.upstreams:
        if name not in methods and name not in cfg.external_upstreams:
            problems.append(
                f"pretrain.methods: unknown upstream method {name!r}; known: {known_names(cfg)}"
            )
    match = cfg.upstream_params.get("control", {}).get("match")
    if match is not None and not (match in methods and methods[match].sgd_schedule):
        schedules = sorted(n for n, e in methods.items() if e.sgd_schedule)
        problems.append(
            f"pretrain.params.control.match: {match!r} has no SGD schedule to match; "
            f"one of {schedules}"
        )
    problems += _missing("finetune.upstreams", cfg.finetune.upstreams, cfg.upstreams, NOT_METHOD)
    for i, g in enumerate(cfg.finetune.extra_grids):
        where = f"finetune.extra_grids.{i}"
        problems += _missing(f"{where}.algorithms", g.algorithms, algos, "unknown algorithm {}")
        problems += _missing(f"{where}.upstreams", g.upstreams, cfg.upstreams, NOT_METHOD)
        problems += _missing(f"{where}.tasks", g.tasks, cfg.tasks, "unknown task {}")
    if cfg.finetune.optimizer == "adam" and cfg.finetune.momentum:
        problems.append(
            "finetune.momentum: adam has no momentum setting (its betas are torch's defaults); "
            "set momentum: 0 or optimizer: sgd"
        )
    for i, entry in enumerate(cfg.finetune.algo_params_for):
        where = f"finetune.algo_params_for.{i}"
        problems += _missing(f"{where}.upstreams", entry.upstreams, cfg.upstreams, NOT_METHOD)
        problems += _missing(f"{where}.tasks", entry.tasks, cfg.tasks, "unknown task {}")
    if not cfg.model.name.startswith("timm:") and cfg.model.name not in models:
        problems.append(
            f"model.name: unknown model {cfg.model.name!r}; "
            f"known: {sorted(models)} or 'timm:<name>'"
        )
    if not 0 < cfg.privacy.delta < 1:
        problems.append("privacy.delta: must be in (0, 1)")
    for i, name in enumerate(cfg.sweeps.methods):
        if name not in methods:
            problems.append(f"sweeps.methods: unknown upstream method {name!r}")
            continue
        for g in cfg.sweeps.gammas:
            variant = format_variant(name, gamma=g)
            found = variant_problems(variant, cfg.upstream_params, f"sweeps.methods.{i}")
            problems += found
            if found:
                break  # the other gammas fail the same way
    problems += _missing("sweeps.tasks", cfg.sweeps.tasks, cfg.tasks, "unknown task {}")
    if cfg.sweeps.algorithm not in algos:
        problems.append(f"sweeps.algorithm: unknown algorithm {cfg.sweeps.algorithm!r}")
    return list(dict.fromkeys(problems))


def _hpo_problems(cfg: Config) -> list[str]:
    """Cross-field checks of the `hpo` section (names, ranges, and a budget the trials fit in)."""
    h, out, algos = cfg.hpo, [], catalog.algorithms()
    out += _missing("hpo.upstreams", h.upstreams, cfg.upstreams, NOT_METHOD)
    out += _missing("hpo.tasks", h.tasks, cfg.tasks, "unknown task {}")
    known = f"unknown algorithm {{}}; known: {sorted(algos)}"
    out += _missing("hpo.algorithms", h.algorithms, algos, known)
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
    out += _missing("federated.upstreams", f.upstreams, cfg.upstreams, NOT_METHOD)
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
    m = f.estimate_points  # the T1 rule's points: rounds 0, s, .., (m-1)s, s = rounds // (2m)
    for t in sorted({f.rounds, *f.rounds_sweep}):
        if f.ut_t1 == "rule" and (m - 1) * max(1, t // (2 * m)) > t - 1:
            out.append(f"federated.estimate_points: {m} points do not fit in {t} rounds")
    return out


def _backbone_problems(cfg: Config, check_files: bool) -> list[str]:
    """timm names, input sizes and weights files of the backbones (the upstream's own checks)."""
    external = cfg.external_upstreams or any(n.split("+")[0] == "external" for n in cfg.upstreams)
    if not cfg.model.name.startswith("timm:") and not external:
        return []  # nothing from timm: no torch import at parse
    from dpadapter.upstream.checks import external_problems

    return external_problems(cfg, check_files)


def _external_problems(cfg: Config) -> list[str]:
    """Labels of `pretrain.external`, and each external upstream's params against the data."""
    out, models = [], catalog.models()
    for label in cfg.external_upstreams:
        if label in catalog.upstreams():
            out.append(
                f"pretrain.external.{label}: the label is a registered method's name; "
                "pick another (it becomes an upstream name)"
            )
        elif label not in cfg.upstreams:
            out.append(f"pretrain.external.{label}: not in pretrain.methods, so never built")
    norm = cfg.data.normalization
    identity = norm is not None and all(m == 0 for m in norm[0]) and all(s == 1 for s in norm[1])
    for name in dict.fromkeys(cfg.upstreams):
        try:
            entry, params, at = resolve(name, cfg.upstream_params, cfg.external_upstreams)
        except (KeyError, ValueError):
            continue
        if entry.name != EXTERNAL:
            continue
        found = param_errors(entry.params_schema, params, at)
        if found:  # e.g. `external` in pretrain.methods with no pretrain.params.external
            out += found
            continue
        model = params["model"]
        if not model.startswith("timm:") and model not in models:
            out.append(
                f"{at}.model: unknown model {model!r}; known: {sorted(models)} or timm:<name>"
            )
            continue
        from dpadapter.upstream.external import External  # timm, for its pretrained_cfg

        method = External(params)
        try:
            method.adapter_spec(1)
        except ValueError as exc:
            out.append(f"{at}.input.normalization: {exc}")
            continue
        if method.normalizes() and not identity:
            out.append(
                f"data.normalization: {at} normalises in its input adapter (input.normalization "
                "is not `data`), so the images must arrive in [0, 1]: set data.normalization to "
                "{mean: [0, ...], std: [1, ...]} (one entry per channel of the data), or "
                f"{at}.input.normalization: data"
            )
    return out


# --- data: class ids, split sizes (from the registry's declared counts, nothing loaded) ------


def _audit_problems(cfg: Config) -> list[str]:
    from dpadapter.audit.stage import audit_problems  # the audit's own cross-field checks

    return audit_problems(cfg)


def _reference_problems(cfg: Config) -> list[str]:
    """The published table must point at runs this config makes, or its columns stay empty."""
    ref, out, algos = cfg.reference, [], catalog.algorithms()
    if ref is None:
        return out
    if ref.upstream not in cfg.upstreams:
        out.append(f"reference.upstream: {ref.upstream!r} is not in pretrain.methods")
    if ref.task not in cfg.tasks:
        out.append(f"reference.task: unknown task {ref.task!r}; known: {sorted(cfg.tasks)}")
    cells = {c.algorithm for c in ref.cells}
    for i, c in enumerate(ref.cells):
        if c.algorithm not in algos:
            out.append(f"reference.cells.{i}.algorithm: unknown algorithm {c.algorithm!r}")
        if c.upstream is not None and c.upstream not in cfg.upstreams:
            out.append(f"reference.cells.{i}.upstream: {c.upstream!r} is not in pretrain.methods")
        if c.task is not None and c.task not in cfg.tasks:
            out.append(f"reference.cells.{i}.task: unknown task {c.task!r}")
    for key in ("baseline", "improved"):
        if getattr(ref, key) not in cells:
            out.append(f"reference.{key}: {getattr(ref, key)!r} has no cell in reference.cells")
    return out


def _classes(split: SplitConfig) -> tuple[int, ...]:
    return split.classes or tuple(range(DATASET_INFO[split.dataset].num_classes))


def _data_problems(cfg: Config) -> list[str]:
    out = []
    roles = [(w, s) for w, s in _roles(cfg) if s.dataset in DATASET_INFO]
    ok_roles = []
    for where, split in roles:
        k = DATASET_INFO[split.dataset].num_classes
        bad = [c for c in split.classes or () if c >= k]
        if bad:
            out.append(
                f"{where}.classes: {bad} out of range: {split.dataset} has classes 0..{k - 1}"
            )
        else:
            ok_roles.append((where, split))
    # The public set and the tasks draw disjointly from each source's train (n_train + n_val)
    # and test (n_test) pools, in config order; a null size takes what is left (at least one).
    for dataset in dict.fromkeys(s.dataset for _, s in ok_roles):
        group = [(w, s) for w, s in ok_roles if s.dataset == dataset]
        info = DATASET_INFO[dataset]
        for pool, counts, what in (
            ("train", info.train_counts, "n_train + n_val"),
            ("test", info.test_counts, "n_test"),
        ):
            # A role may draw its training or test examples from the other split of the
            # source (`train_split` / `test_split`): count what each role takes from this one.
            def demand(s, pool=pool):
                need = (s.n_train or 1) + s.n_val if s.train_split == pool else 0
                return need + ((s.n_test or 1) if s.test_split == pool else 0)

            members = [(w, s) for w, s in group if demand(s)]
            out += _pool_problems(members, pool, counts, demand, what, dataset)
    return out + _channel_problems(roles)


def _channel_problems(roles: list[tuple[str, SplitConfig]]) -> list[str]:
    """Every role must reach the model with the public set's channels (one model for all)."""

    def channels(split: SplitConfig) -> int | None:
        own = DATASET_INFO[split.dataset].channels
        if own is None or split.channels is None or own == split.channels:
            return own
        return split.channels if own == 1 else -own  # -own: cannot be converted

    out, public = [], None
    for where, split in roles:
        c = channels(split)
        if c is not None and c < 0:
            out.append(
                f"{where}.channels: {split.dataset} has {-c}-channel images; only 1-channel "
                "images can be replicated"
            )
        elif where == "public":
            public = c
        elif c is not None and public is not None and c != public:
            hint = f"; set {where}.channels: {public}" if c == 1 else ""
            out.append(
                f"{where}: {split.dataset} gives {c}-channel images, the public set "
                f"{public}-channel ones{hint}"
            )
    return out


def _pool_problems(group, pool, counts, demand, what, dataset) -> list[str]:
    """Sets of roles asking for more examples of their classes than the pool holds.

    Every set of roles sharing the pool is checked (the smallest failing ones are reported):
    k roles needing n_1..n_k examples of the union U of their classes fit only if
    sum n_i <= |pool restricted to U|. This is necessary; whether the random draw leaves
    enough of one class for a later role is known only when the job allocates.
    """
    out: list[str] = []
    failed: list[frozenset[int]] = []
    sizes = range(1, len(group) + 1)
    if len(group) > _MAX_ROLES_FOR_SUBSETS:
        sizes = [1, len(group)]
    for r in sizes:
        for subset in itertools.combinations(range(len(group)), r):
            if any(f <= set(subset) for f in failed):
                continue
            classes = sorted({c for i in subset for c in _classes(group[i][1])})
            have = sum(counts[c] for c in classes)
            need = sum(demand(group[i][1]) for i in subset)
            if need > have:
                failed.append(frozenset(subset))
                names = " + ".join(group[i][0] for i in subset)
                out.append(
                    f"{group[subset[-1]][0]}.{what.split(' ')[0]}: {names} ask for {need} "
                    f"{pool} examples ({what}) of {dataset} classes {classes}, which has "
                    f"{have} (they draw disjointly from one pool)"
                )
    return out


# --- privacy: delta against the task sizes, epsilon the calibration can reach ----------------


def _task_sizes(cfg: Config) -> dict[str, int]:
    """Training examples of each task (an upper bound where n_train is null)."""
    out = {}
    for name, t in cfg.tasks.items():
        if t.dataset not in DATASET_INFO:
            continue
        info = DATASET_INFO[t.dataset]
        if any(c >= info.num_classes for c in t.classes or ()):
            continue
        counts = info.train_counts if t.train_split == "train" else info.test_counts
        out[name] = t.n_train or sum(counts[c] for c in _classes(t)) - t.n_val
    return out


def _privacy_problems(cfg: Config) -> list[str]:
    out = []
    delta = cfg.privacy.delta
    if not 0 < delta < 1:
        return out
    sizes = {n: s for n, s in _task_sizes(cfg).items() if s > 0}
    if sizes:
        task, n = min(sizes.items(), key=lambda kv: kv[1])
        if delta >= 1 / n:
            out.append(
                f"privacy.delta: {delta:g} is not below 1/n = {1 / n:.3g} for task {task!r} "
                f"({n} training examples): a delta of 1/n allows releasing an example outright; "
                f"use delta << 1/n (e.g. 1.0e-5)"
            )
            return out
    ft = cfg.finetune
    grids: dict[str, dict[float, str]] = {}
    for _, t, _, e, _ in cfg.finetune_grid():
        grids.setdefault(t, {}).setdefault(float(e), "finetune.epsilons")
    if "dpadapter" in cfg.sweeps.methods:  # the sweeps fine-tune DPAdapter's variants only
        for t in cfg.sweeps.tasks or tuple(cfg.tasks):
            grids.setdefault(t, {}).setdefault(float(cfg.sweeps.epsilon), "sweeps.epsilon")
    for task, epsilons in grids.items():
        n = sizes.get(task)
        if n is None:
            continue
        if ft.batch_size > n:
            out.append(
                f"finetune.batch_size: {ft.batch_size} exceeds task {task!r}'s {n} training "
                "examples"
            )
            continue
        q = ft.batch_size / n
        steps = ft.epochs * int(1 / q)
        top = max_reachable_epsilon(delta, q, steps)
        for eps in sorted(e for e in epsilons if e > top):
            out.append(
                f"{epsilons[eps]}: epsilon {eps:g} on task {task!r} is out of reach of the "
                f"sigma calibration: even sigma = {SIGMA_MIN} (negligible noise) gives "
                f"epsilon <= {top:.3g} for {ft.epochs} epochs at sample rate {q:.3g}; use an "
                "epsilon below that"
            )
    return out
