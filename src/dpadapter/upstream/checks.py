"""The checks of a backbone from elsewhere, run by the validation before any job starts.

Each mistake here used to surface inside a job: a misspelled timm name in the pretrain job
(timm's `Unknown model`, no key, no suggestion), an input size the backbone cannot take at
fine-tuning (a torch assertion, after the pretrain job had written its checkpoint), a checkpoint
whose keys do not match in the pretrain job's log (a hundred names). Here each is found from the
config alone and named by its key: the name against timm's registry with close matches; the
size by building the backbone on the meta device (no memory, no weights) and running one
forward at the size the input adapter hands it; the weights file's keys and shapes against that
backbone (read lazily: a memory-mapped torch file, a safetensors header), with the classifier
left out exactly as the pretrain job leaves it out. Only configs that name a timm backbone or
an external upstream import timm or torch here; the default config's parse stays light.

Below them, the names and params of `pretrain` and `sweeps` (the gamma sweeps are upstream
methods at several radii) against the registry and the rest of the config, read from
`dpadapter.registries.catalog` without torch. Each problem is a `key: text` line;
`dpadapter.validation.compose`
composes them.
"""

from __future__ import annotations

import contextlib
import difflib
import hashlib
import json
import sys
import tempfile
from collections.abc import Collection, Iterator
from contextvars import ContextVar
from pathlib import Path
from typing import Any

from dpadapter.ground.param_schema import param_errors
from dpadapter.registries import catalog
from dpadapter.settings import Config, ModelConfig
from dpadapter.settings.errors import missing
from dpadapter.upstream.resolve import EXTERNAL, known_names, resolve
from dpadapter.upstream.variants import format_variant, parse_variant

SHOWN = 3  # names per kind of mismatch in the message; the full list goes to a log file

# The upstreams whose backbones are checked (None: all). The workflow checks every backbone
# before any job; a job validates its config again but builds at most one backbone from it (a
# fine-tuning job none: it rebuilds from the checkpoint's record, dpadapter.launch.cli), and
# each meta build and forward costs it about 0.1 s of CPU (a grid of 5 ViTs paid 0.5 s per job).
_ONLY: ContextVar[frozenset[str] | None] = ContextVar("dpadapter_checked_upstreams", default=None)


@contextlib.contextmanager
def only_backbones(upstreams: Collection[str] | None) -> Iterator[None]:
    """Within: `external_problems` checks the backbones of `upstreams` only (None: all)."""
    token = _ONLY.set(None if upstreams is None else frozenset(upstreams))
    try:
        yield
    finally:
        _ONLY.reset(token)


def timm_name_problem(model: str, at: str) -> str | None:
    """`timm:<name>` (a pretrained tag allowed) must be a model timm has registered."""
    import timm

    name = model.removeprefix("timm:")
    if timm.is_model(name):
        return None
    arch = name.split(".", 1)[0]
    close = difflib.get_close_matches(arch, timm.list_models(), n=3, cutoff=0.75)
    hint = f"; did you mean {', '.join(f'timm:{c}' for c in close)}?" if close else ""
    return f"{at}: timm has no model {name!r}{hint} (timm.list_models() lists them)"


def file_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Names and shapes of a weights file's tensors without reading the tensors."""
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
    from dpadapter.upstream.external import read_state_dict

    return {k: tuple(v.shape) for k, v in read_state_dict(path, mmap=True).items()}


def _meta_backbone(params: dict[str, Any], cfg: Config, in_chans: int):
    import torch

    from dpadapter.models import create_model

    mc = ModelConfig(params["model"], cfg.model.groups, cfg.model.width, "freeze")
    with torch.device("meta"):
        return create_model(mc, 10, in_chans, 0, timm_args=dict(params.get("timm_args", {})))


def _data_channels(cfg: Config) -> int | None:
    from dpadapter.data.registry import DATASET_INFO

    info = DATASET_INFO.get(cfg.public.dataset)
    return cfg.public.channels or (info.channels if info else None)


def external_problems(cfg: Config, check_files: bool) -> list[str]:
    """Every external upstream's timm name, input size and (with `check_files`) weights."""
    out: list[str] = []
    if cfg.model.name.startswith("timm:"):
        problem = timm_name_problem(cfg.model.name, "model.name")
        out += [problem] if problem else []
    only = _ONLY.get()
    for name in dict.fromkeys(cfg.upstreams):
        if only is not None and name not in only:
            continue
        try:
            entry, params, at = resolve(name, cfg.upstream_params, cfg.external_upstreams)
        except (KeyError, ValueError):
            continue  # named by the validation's name checks
        if entry.name != EXTERNAL or not str(params.get("model", "")).startswith("timm:"):
            continue
        problem = timm_name_problem(params["model"], f"{at}.model")
        if problem:
            out.append(problem)
            continue
        out += _fit_problems(cfg, params, at, check_files)
    return out


def _fit_problems(cfg: Config, params: dict[str, Any], at: str, check_files: bool) -> list[str]:
    import torch

    from dpadapter.upstream.external import External, head_prefix

    method = External(params)
    data_chans = _data_channels(cfg)
    try:
        spec = method.adapter_spec(data_chans or 3)
    except ValueError:
        return []  # the normalisation problem is the validation's own message
    in_chans = (spec.channels if spec else None) or data_chans or 3
    try:
        backbone = _meta_backbone(params, cfg, in_chans)
    except Exception as exc:  # timm refuses the arguments themselves
        return [f"{at}.timm_args: timm cannot build {params['model']}: {exc}"]
    out = []
    size = spec.size if spec else None
    if size is not None:
        try:
            with torch.no_grad():
                backbone(torch.empty(2, in_chans, size, size, device="meta"))
        except Exception as exc:
            key = "input.size" if params.get("input", {}).get("size") else "timm_args"
            out.append(
                f"{at}.{key}: {params['model']} cannot take {size}x{size} inputs "
                f"(the size its input adapter gives it): {str(exc).splitlines()[0]}"
            )
    weights = params.get("weights", {})
    if check_files and "file" in weights:
        head = head_prefix(backbone) + "."
        out += _weight_problems(backbone, params, at, head)
    return out


def mismatch_log(at: str, listing: str) -> Path:
    """Where the validation lists every key of a checkpoint that does not fit its backbone.

    Named by the listing's content, outside any results folder: the validation also checks
    an overlay's base on its own (`problems.locate`), whose results folder is not the one run,
    and a problem the base has too must read the same to be recognised as the base's."""
    digest = hashlib.sha256(listing.encode()).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / "dpadapter-validation" / f"{at}.weights-{digest}.log"


def _weight_problems(backbone, params: dict[str, Any], at: str, head: str) -> list[str]:
    from dpadapter.upstream.external import WeightsUnavailable, locate_weights

    try:
        _, path = locate_weights(params)
        given = file_shapes(path)
    except WeightsUnavailable:
        return []  # the validation's weight check names the missing file
    except Exception as exc:
        return [f"{at}.weights: cannot read {params['weights']['file']}: {exc}"]
    from dpadapter.upstream.external import state_mismatch

    own = {k: tuple(v.shape) for k, v in backbone.state_dict().items()}
    missing, unexpected, shapes = state_mismatch(own, given, head)
    if not (missing or unexpected or shapes):
        return []
    listing = (
        f"{at}.weights: {path} against {params['model']} with timm_args "
        f"{json.dumps(params.get('timm_args') or {})} (classifier {head[:-1]!r} aside):\n"
        + "".join(f"  missing: {k}\n" for k in missing)
        + "".join(f"  not in the model: {k}\n" for k in unexpected)
        + "".join(f"  shape: {k}\n" for k in shapes)
    )
    # A checkpoint of another architecture has hundreds of keys: printed, they buried the
    # one-line refusal under them (issue 50). The console gets counts and a few names.
    every = _write_listing(mismatch_log(at, listing), listing)
    if missing or unexpected:
        parts = [
            f"{len(names)} {what} ({_few(names, sep)})"
            for what, names, sep in (
                ("missing from the file", missing, ", "),
                ("not in the model", unexpected, ", "),
                ("with other shapes", shapes, "; "),  # a shape has commas of its own
            )
            if names
        ]
        return [
            f"{at}.weights: {path} does not fit {params['model']}: {'; '.join(parts)}. Check "
            f"{at}.model and {at}.timm_args against what the checkpoint was saved from "
            f"({every})"
        ]
    # Same keys, other shapes: the same architecture configured otherwise (a ViT's patch_size
    # or img_size, a width). The shapes follow model and timm_args, so the refusal is keyed
    # there, not at `weights`, whose overlay hint ("set weights") was no fix.
    args = params.get("timm_args") or {}
    key = f"{at}.timm_args" if args else f"{at}.model"
    made = f"{at}.timm_args {json.dumps(args)}" if args else f"no {at}.timm_args (timm's defaults)"
    return [
        f"{key}: {path} was saved from another configuration of {params['model']}: "
        f"{len(shapes)} keys with other shapes ({_few(shapes, '; ')}); the model's shapes come "
        f"from {at}.model with {made}. Set them as the checkpoint was saved, or point {at}.weights "
        f"at a checkpoint saved with these ({every})"
    ]


def _few(names: list[str], sep: str) -> str:
    more = f"{sep}… (+{len(names) - SHOWN})" if len(names) > SHOWN else ""
    return sep.join(names[:SHOWN]) + more


def _write_listing(path: Path, text: str) -> str:
    """The full listing into `path` (what the message then says), else on stderr."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    except OSError:
        print(text, file=sys.stderr)
        return "every key is listed on stderr above"
    return f"every key: {path}"


# --- the config's upstream names and params (no torch) ---------------------------------------


def method_problems(cfg: Config) -> list[str]:
    """`pretrain.methods` against the registry and `pretrain.external`; what `control` matches."""
    problems, methods = [], catalog.upstreams()
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
    return problems


def sweep_problems(cfg: Config) -> list[str]:
    """The gamma sweeps' methods (each variant against its params schema), tasks, algorithm."""
    problems, methods, algos = [], catalog.upstreams(), catalog.algorithms()
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
    problems += missing("sweeps.tasks", cfg.sweeps.tasks, cfg.tasks, "unknown task {}")
    if cfg.sweeps.algorithm not in algos:
        problems.append(f"sweeps.algorithm: unknown algorithm {cfg.sweeps.algorithm!r}")
    return problems


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
            continue  # reported by method_problems
        if entry.name != EXTERNAL or "weights" not in params:
            continue
        from dpadapter.upstream.external import WeightsUnavailable, locate_weights

        try:
            locate_weights(params)
        except WeightsUnavailable as exc:
            out.append(f"{at}.weights: {exc}")
    return out


def label_problems(cfg: Config) -> list[str]:
    """Labels of `pretrain.external`, and each external upstream's params against the data."""
    out, models = [], catalog.models()
    for label in cfg.external_upstreams:
        if label in catalog.upstreams():
            out.append(
                f"pretrain.external.{label}: the label is a registered method's name; "
                "pick another (it becomes an upstream name)"
            )
        elif label not in cfg.upstreams:
            out.append(
                f"pretrain.external.{label}: not in pretrain.methods, so never built: list it "
                "there or remove the entry"
            )
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


def backbone_problems(cfg: Config, check_files: bool) -> list[str]:
    """timm names, input sizes and weights files of the backbones (`external_problems`), only
    where a config names a timm model or an external upstream: no torch import otherwise."""
    external = cfg.external_upstreams or any(n.split("+")[0] == "external" for n in cfg.upstreams)
    if not cfg.model.name.startswith("timm:") and not external:
        return []
    return external_problems(cfg, check_files)
