"""`external`: a backbone pre-trained elsewhere, loaded instead of trained.

Three of the four papers start from a public checkpoint (an ImageNet ViT, a CIFAR-100 ResNet20).
The weights come from a local file (`.safetensors`, `.pth`/`.pt` holding a state dict, a timm or
torchvision checkpoint dict, or this pipeline's own checkpoint), from the Hugging Face hub cache
through timm, or from torchvision's cache in `TORCH_HOME`. Nothing is ever downloaded by a job:
the workflow's validation (`weight_problems`) refuses a config whose weights are not on disk,
naming the path or hub id and the command that fetches it on a machine with internet.

The loaded state must fit the backbone exactly, the classifier aside (it is replaced per task):
a missing or unexpected key, or a shape that differs, is refused by name. The pretrain job then
saves an ordinary pipeline checkpoint recording the backbone it built (`checkpoint_model`), so
fine-tuning, HPO and the federated stage rebuild that backbone rather than `model:` of the
config, together with where the weights came from and their sha256 (`provenance`).

Several backbones in one config are labels of `pretrain.external` (`dpadapter.upstream.resolve`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dpadapter.ground.param_schema import POSITIVE_INT, nullable, params_object
from dpadapter.models import create_model, with_timm_args
from dpadapter.models.batchnorm import BATCHNORM_CHOICES, apply_batchnorm_choice
from dpadapter.models.input_adapter import AdapterSpec, adapt
from dpadapter.settings import ModelConfig
from dpadapter.train.checkpoint import file_sha256
from dpadapter.upstream.base import UpstreamContext, UpstreamMethod, register_upstream

_NORMALIZATION = {
    "description": (
        "pretrained: the backbone's pretrained_cfg mean/std (timm); data: the pipeline's own "
        "data.normalization (the adapter does not normalise); or {mean, std}"
    ),
    "oneOf": [
        {"enum": ["pretrained", "data"]},
        {
            "type": "object",
            "additionalProperties": False,
            "required": ["mean", "std"],
            "properties": {
                "mean": {"type": "array", "minItems": 1, "items": {"type": "number"}},
                "std": {
                    "type": "array",
                    "minItems": 1,
                    "items": {"type": "number", "exclusiveMinimum": 0},
                },
            },
        },
    ],
}

_WEIGHTS = {
    "description": "{file: path}, {hub: true[, hub_id]} or {torchvision: enum}",
    "oneOf": [
        {
            "type": "object",
            "additionalProperties": False,
            "required": ["file"],
            "properties": {
                "file": {
                    "type": "string",
                    "minLength": 1,
                    "description": ".safetensors, .pth/.pt (a state dict or a checkpoint dict)",
                }
            },
        },
        {
            "type": "object",
            "additionalProperties": False,
            "required": ["hub"],
            "properties": {
                "hub": {
                    "const": True,
                    "description": "timm's pretrained weights, from the HF cache",
                },
                "hub_id": {
                    "type": "string",
                    "description": "Hugging Face repo id instead of the timm name's own",
                },
            },
        },
        {
            "type": "object",
            "additionalProperties": False,
            "required": ["torchvision"],
            "properties": {
                "torchvision": {
                    "type": "string",
                    "pattern": "^[A-Za-z0-9_]+_Weights\\.[A-Z0-9_]+$",
                    "description": "weights enum, e.g. ResNet18_Weights.IMAGENET1K_V1",
                }
            },
        },
    ],
}

PARAMS_SCHEMA = {
    **params_object(
        model={"type": "string", "description": "timm:<name> or a pipeline model (resnet20-gn)"},
        weights=_WEIGHTS,
        timm_args={"type": "object", "description": "extra timm.create_model arguments"},
        batchnorm={"enum": [*BATCHNORM_CHOICES, None], "description": "null: model.batchnorm"},
        input={
            "type": "object",
            "additionalProperties": False,
            "description": "the InputAdapter in front of the backbone",
            "properties": {
                "size": nullable({**POSITIVE_INT, "description": "null: pretrained_cfg's"}),
                "channels": nullable({**POSITIVE_INT, "description": "null: the backbone's"}),
                "normalization": _NORMALIZATION,
            },
        },
    ),
    "required": ["model", "weights"],
}


def hub_cache_dir() -> Path:
    """The HF hub cache as the environment names it now (HF_HUB_CACHE, else HF_HOME/hub)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "huggingface"
    )
    return Path(home) / "hub"


def torch_hub_dir() -> Path:
    return Path(torch.hub.get_dir())  # TORCH_HOME/hub, read at call time


def _pretrained_cfg(model: str):
    if not model.startswith("timm:"):
        return None
    from timm.models import get_pretrained_cfg

    return get_pretrained_cfg(model[5:])


class WeightsUnavailable(FileNotFoundError):
    """Weights not on this machine; the message says where they were looked for and how to fetch."""


def locate_weights(params: dict[str, Any]) -> tuple[str, Path]:
    """(source, file): where the weights are, or `WeightsUnavailable` with the fetch command."""
    w, model = params["weights"], params["model"]
    if "file" in w:
        path = Path(w["file"])
        if not path.is_file():
            raise WeightsUnavailable(
                f"weights file {path} not found; copy the checkpoint there (then `dvc add {path}` "
                "to version it), or point weights.file at it"
            )
        return str(path), path
    if "torchvision" in w:
        return w["torchvision"], _torchvision_file(w["torchvision"])
    return _hub_file(model, w.get("hub_id"))


def _hub_file(model: str, hub_id: str | None) -> tuple[str, Path]:
    cfg = _pretrained_cfg(model)
    if hub_id is None and cfg is None:
        raise WeightsUnavailable(
            f"{model!r} has no pretrained weights in timm's registry; give weights.hub_id, a "
            "weights.file, or a timm:<name> that has them"
        )
    repo = hub_id or (cfg.hf_hub_id if cfg is not None else None)
    name = model[5:]
    if repo:
        from huggingface_hub import try_to_load_from_cache

        filenames = [cfg.hf_hub_filename] if cfg is not None and cfg.hf_hub_filename else []
        filenames += ["model.safetensors", "pytorch_model.bin", "open_clip_model.safetensors"]
        for fn in filenames:
            found = try_to_load_from_cache(repo, fn, cache_dir=str(hub_cache_dir()))
            if isinstance(found, str) and Path(found).is_file():
                return f"hf-hub:{repo}", Path(found)
        fetch = (
            f"`HF_HOME={hub_cache_dir().parent} huggingface-cli download {repo}`"
            if hub_id
            else f'`HF_HOME={hub_cache_dir().parent} python -c "import timm; '
            f"timm.create_model('{name}', pretrained=True)\"`"
        )
        raise WeightsUnavailable(
            f"hub weights {repo} are not in the Hugging Face cache {hub_cache_dir()} (jobs never "
            f"download); fetch them on a machine with internet with {fetch} and copy that cache "
            "here (or set HF_HOME to where it is)"
        )
    path = torch_hub_dir() / "checkpoints" / os.path.basename(cfg.url)
    if path.is_file():
        return cfg.url, path
    raise WeightsUnavailable(
        f"weights of {name} ({cfg.url}) are not in {path.parent}; fetch them on a machine with "
        f'internet with `TORCH_HOME={torch_hub_dir().parent} python -c "import timm; '
        f"timm.create_model('{name}', pretrained=True)\"` and copy {path} here"
    )


def _torchvision_file(enum_name: str) -> Path:
    from torchvision.models import get_weight

    try:
        url = get_weight(enum_name).url
    except (ValueError, KeyError, AttributeError) as exc:
        raise WeightsUnavailable(f"unknown torchvision weights {enum_name!r}: {exc}") from None
    path = torch_hub_dir() / "checkpoints" / os.path.basename(url)
    if not path.is_file():
        raise WeightsUnavailable(
            f"torchvision weights {enum_name} are not in {path.parent}; fetch them on a machine "
            f'with internet with `TORCH_HOME={torch_hub_dir().parent} python -c "from '
            f"torchvision.models import get_weight; get_weight('{enum_name}').get_state_dict()\"` "
            f"and copy {path} here"
        )
    return path


def read_state_dict(path: Path, mmap: bool = False) -> dict[str, torch.Tensor]:
    """The tensors of a weights file, whatever wrapper it comes in (never unpickles code).

    `mmap` maps a torch file instead of reading it (the validation wants the shapes only); a
    file in the legacy format, which cannot be mapped, is read."""
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path), device="cpu")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except RuntimeError:
        if not mmap:
            raise
        obj = torch.load(path, map_location="cpu", weights_only=True)
    for key in ("state_dict", "model", "state_dict_ema", "model_ema"):
        if isinstance(obj, dict) and isinstance(obj.get(key), dict) and _all_tensors(obj[key]):
            obj = obj[key]
            break
    if not isinstance(obj, dict) or not _all_tensors(obj):
        raise ValueError(f"{path}: no state dict found (a mapping of names to tensors)")
    # DataParallel's `module.` and this pipeline's adapted models' `backbone.` prefixes
    for prefix in ("module.", "backbone."):
        if obj and all(k.startswith(prefix) for k in obj):
            obj = {k[len(prefix) :]: v for k, v in obj.items()}
    return dict(obj)


def _all_tensors(d: dict) -> bool:
    return bool(d) and all(isinstance(v, torch.Tensor) for v in d.values())


def head_prefix(model: nn.Module) -> str:
    """The classifier's module name (`head`, `fc`, ...): its keys are never loaded."""
    head = model.get_classifier()
    for name, module in model.named_modules():
        if module is head:
            return name
    raise ValueError("the model's classifier is not one of its modules")


def state_mismatch(
    own: dict[str, tuple[int, ...]], given: dict[str, tuple[int, ...]], head: str
) -> tuple[list[str], list[str], list[str]]:
    """(missing from `given`, not in the model, shapes that differ), the classifier `head.`
    aside: the one comparison of the validation (upstream.checks) and of the load below."""
    keep = {k: v for k, v in given.items() if not k.startswith(head)}
    missing = sorted(k for k in own if k not in keep and not k.startswith(head))
    unexpected = sorted(set(keep) - set(own))
    shapes = [
        f"{k}: {tuple(v)} in the file, {tuple(own[k])} in the model"
        for k, v in keep.items()
        if k in own and tuple(v) != tuple(own[k])
    ]
    return missing, unexpected, shapes


def load_backbone_state(model: nn.Module, state: dict[str, torch.Tensor], source: str) -> list[str]:
    """Load everything but the classifier, refusing any other mismatch by name; return the
    classifier keys of `state` that were left out."""
    head = head_prefix(model) + "."
    own = model.state_dict()
    dropped = sorted(k for k in state if k.startswith(head))
    keep = {k: v for k, v in state.items() if not k.startswith(head)}
    missing, unexpected, shapes = state_mismatch(
        {k: tuple(v.shape) for k, v in own.items()},
        {k: tuple(v.shape) for k, v in state.items()},
        head,
    )
    problems = []
    if missing:
        problems.append(f"missing from the weights: {', '.join(missing)}")
    if unexpected:
        problems.append(f"not in the model: {', '.join(unexpected)}")
    if shapes:
        problems.append("shapes differ: " + "; ".join(shapes))
    if problems:
        raise ValueError(
            f"weights {source} do not fit the backbone (the classifier {head[:-1]!r} aside):\n  "
            + "\n  ".join(problems)
        )
    model.load_state_dict({**{k: own[k] for k in own if k.startswith(head)}, **keep})
    return dropped


@register_upstream("external")
class External(UpstreamMethod):
    """Weights pre-trained elsewhere; sees neither the warm-up nor the public data."""

    needs_warmup = False
    needs_public_data = False
    # The public test accuracy of a head trained on other classes means nothing.
    public_report = False
    params_schema = PARAMS_SCHEMA

    def __init__(self, params: dict[str, Any] | None = None):
        super().__init__(params)
        self._record: dict[str, Any] | None = None
        self._in_chans: int | None = None
        self._provenance: dict[str, Any] | None = None

    @classmethod
    def default_params(cls) -> dict[str, Any]:
        return {"timm_args": {}, "batchnorm": None, "input": {}}

    def adapter_spec(self, data_in_chans: int) -> AdapterSpec | None:
        """The input adapter from `input` and the backbone's pretrained_cfg (public numbers)."""
        p, inp = self.params, self.params.get("input", {})
        cfg = _pretrained_cfg(p["model"])
        timm_args = p.get("timm_args", {})
        size = inp.get("size")
        if size is None and cfg is not None:
            size = timm_args.get("img_size") or cfg.input_size[-1]
        channels = inp.get("channels")
        if channels is None:
            channels = timm_args.get("in_chans") or (cfg.input_size[0] if cfg else data_in_chans)
        norm = inp.get("normalization", "pretrained" if cfg is not None else "data")
        mean = std = None
        if norm == "pretrained":
            if cfg is None or cfg.mean is None:
                raise ValueError(
                    f"{p['model']}: no pretrained_cfg mean/std; set input.normalization"
                )
            mean, std = tuple(cfg.mean), tuple(cfg.std)
        elif isinstance(norm, dict):
            mean, std = tuple(norm["mean"]), tuple(norm["std"])
        return AdapterSpec(
            size=size,
            channels=channels if channels != data_in_chans else None,
            mean=mean,
            std=std,
        )

    def normalizes(self) -> bool:
        """Whether the adapter normalises (then the data must arrive in [0, 1])."""
        norm = self.params.get("input", {}).get("normalization")
        if norm is None:
            norm = "pretrained" if self.params["model"].startswith("timm:") else "data"
        return norm != "data"

    def build(self, ctx: UpstreamContext) -> nn.Module:
        p = self.params
        source, path = locate_weights(p)
        spec = self.adapter_spec(ctx.plan.in_chans)
        in_chans = (spec.channels if spec else None) or ctx.plan.in_chans
        n_classes = len(ctx.plan.allocations["public"].classes)
        choice = p["batchnorm"] or ctx.cfg.model.batchnorm
        mc = ModelConfig(p["model"], ctx.cfg.model.groups, ctx.cfg.model.width, "freeze")
        timm_args = dict(p.get("timm_args", {}))
        if "hub" in p["weights"]:
            backbone, dropped = self._from_hub(mc, path, n_classes, in_chans, timm_args, ctx.seed)
        else:
            backbone = create_model(mc, n_classes, in_chans, ctx.seed, timm_args=timm_args)
            dropped = load_backbone_state(backbone, read_state_dict(path), source)
        # BatchNorm statistics came with the weights; groupnorm drops them now, freeze keeps them.
        backbone = apply_batchnorm_choice(backbone, choice)
        self._record = {
            "name": mc.name,
            "groups": mc.groups,
            "width": mc.width,
            "batchnorm": choice,
            **({"timm_args": timm_args} if timm_args else {}),
            **({"input": spec.to_dict()} if spec and spec != AdapterSpec() else {}),
        }
        self._in_chans = in_chans
        self._provenance = {
            "kind": next(iter(k for k in ("file", "hub", "torchvision") if k in p["weights"])),
            "source": source,
            "file": str(path),
            "sha256": file_sha256(path),
            "classifier_keys_dropped": dropped,
        }
        return adapt(backbone, spec)

    @staticmethod
    def _from_hub(mc, path, n_classes, in_chans, timm_args, seed):
        """timm's own loader on the cached file (its filters convert original checkpoints)."""
        import timm

        torch.manual_seed(seed)

        def build(args: dict) -> nn.Module:
            return timm.create_model(
                mc.name[5:],
                pretrained=True,
                pretrained_cfg_overlay={"file": str(path)},
                num_classes=n_classes,
                in_chans=in_chans,
                **args,
            )

        model = with_timm_args(mc.name[5:], build, timm_args)
        return model, ["(timm: classifier reset for the public classes)"]

    def checkpoint_model(self, ctx: UpstreamContext) -> tuple[dict[str, Any], int]:
        assert self._record is not None and self._in_chans is not None, "build first"
        return self._record, self._in_chans

    def provenance(self) -> dict[str, Any] | None:
        return self._provenance
