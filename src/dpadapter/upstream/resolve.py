"""One answer to "which method, with which params, is the upstream named X?".

An upstream name is a registered method (`dpadapter`), a variant of one (`dpadapter+gamma=0.5`,
`dpadapter.upstream.variants`), or a label of `pretrain.external` (`vit-s`, the `external`
method with that label's params), usable wherever a method name is (`pretrain.methods`,
`finetune.upstreams`, `hpo.upstreams`, `federated.upstreams`). The validation, the pretrain
job and the workflow's rules all look names up here, so a label behaves as a method.

Names resolve against `dpadapter.registries.catalog` (what the registry holds, read without torch),
so the
validation and the rules' input functions run at parse time without importing any method;
`method_for`, which constructs one, imports the registry.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dpadapter.registries import catalog
from dpadapter.settings import Config
from dpadapter.upstream.variants import parse_variant

if TYPE_CHECKING:
    from dpadapter.upstream.base import UpstreamMethod

EXTERNAL = "external"


def resolve(
    name: str,
    upstream_params: dict[str, dict[str, Any]],
    external: dict[str, dict[str, Any]] | None = None,
) -> tuple[catalog.Upstream, dict[str, Any], str]:
    """(the method's catalog entry, params it is constructed with, where those params live in
    the config).

    A `KeyError` names an unknown method; a `ValueError` a malformed variant name.
    """
    base, overrides = parse_variant(name)
    external = external or {}
    methods = catalog.upstreams()
    if base in external:
        return methods[EXTERNAL], {**external[base], **overrides}, f"pretrain.external.{base}"
    if base not in methods:
        known = sorted(methods) + sorted(external)
        raise KeyError(f"unknown upstream method {base!r}; known: {known}")
    return (
        methods[base],
        {**upstream_params.get(base, {}), **overrides},
        f"pretrain.params.{base}",
    )


def known_names(cfg: Config) -> list[str]:
    return sorted(catalog.upstreams()) + sorted(cfg.external_upstreams)


def method_for(cfg: Config, name: str) -> UpstreamMethod:
    """The method instance the pretrain job of upstream `name` runs."""
    from dpadapter.upstream import UPSTREAMS

    entry, params, _ = resolve(name, cfg.upstream_params, cfg.external_upstreams)
    return UPSTREAMS[entry.name](params)


def method_class(cfg: Config, name: str) -> catalog.Upstream:
    """The catalog entry of upstream `name` (its `needs_warmup`, `params_schema`)."""
    return resolve(name, cfg.upstream_params, cfg.external_upstreams)[0]


def weights_file(cfg: Config, name: str) -> str | None:
    """The local weights file an external upstream reads (a rule input), else None."""
    entry, params, _ = resolve(name, cfg.upstream_params, cfg.external_upstreams)
    if entry.name != EXTERNAL:
        return None
    return params.get("weights", {}).get("file")
