"""One answer to "which method, with which params, is the upstream named X?".

An upstream name is a registered method (`dpadapter`), a variant of one (`dpadapter+gamma=0.5`,
`dpadapter.upstream.variants`), or a label of `pretrain.external` (`vit-s`, the `external`
method with that label's params), usable wherever a method name is (`pretrain.methods`,
`finetune.upstreams`, `hpo.upstreams`, `federated.upstreams`). The validation, the pretrain
job and the workflow's rules all look names up here, so a label behaves as a method.
"""

from __future__ import annotations

from typing import Any

from dpadapter.config import Config
from dpadapter.upstream.base import UPSTREAMS, UpstreamMethod
from dpadapter.upstream.variants import parse_variant

EXTERNAL = "external"


def resolve(
    name: str,
    upstream_params: dict[str, dict[str, Any]],
    external: dict[str, dict[str, Any]] | None = None,
) -> tuple[type[UpstreamMethod], dict[str, Any], str]:
    """(method class, params it is constructed with, where those params live in the config).

    A `KeyError` names an unknown method; a `ValueError` a malformed variant name.
    """
    base, overrides = parse_variant(name)
    external = external or {}
    if base in external:
        return UPSTREAMS[EXTERNAL], {**external[base], **overrides}, f"pretrain.external.{base}"
    if base not in UPSTREAMS:
        known = sorted(UPSTREAMS) + sorted(external)
        raise KeyError(f"unknown upstream method {base!r}; known: {known}")
    return (
        UPSTREAMS[base],
        {**upstream_params.get(base, {}), **overrides},
        f"pretrain.params.{base}",
    )


def known_names(cfg: Config) -> list[str]:
    return sorted(UPSTREAMS) + sorted(cfg.external_upstreams)


def method_for(cfg: Config, name: str) -> UpstreamMethod:
    """The method instance the pretrain job of upstream `name` runs."""
    cls, params, _ = resolve(name, cfg.upstream_params, cfg.external_upstreams)
    return cls(params)


def method_class(cfg: Config, name: str) -> type[UpstreamMethod]:
    return resolve(name, cfg.upstream_params, cfg.external_upstreams)[0]


def weights_file(cfg: Config, name: str) -> str | None:
    """The local weights file an external upstream reads (a rule input), else None."""
    cls, params, _ = resolve(name, cfg.upstream_params, cfg.external_upstreams)
    if cls.name != EXTERNAL:
        return None
    return params.get("weights", {}).get("file")
