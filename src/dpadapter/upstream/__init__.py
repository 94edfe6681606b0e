"""The upstream (pre-training) methods' registry, `UPSTREAMS`, filled on first use.

The method modules import torch, so they are imported when a name below is first read: the
torch-free parts of this package (`resolve`, `variants`) serve the workflow's parse without
them. The registry's order, which the config schema's `pretrain.params` follows, is the order
of `_METHOD_MODULES` whichever module a process happened to import first.

Layer 5 (an experiment built on the loops): it may import `train` and everything below, and
the other experiments of its layer, never a stage or an entry point.
"""

from __future__ import annotations

__all__ = ["UPSTREAMS", "UpstreamContext", "UpstreamMethod", "register_upstream"]

_METHOD_MODULES = ("basic", "control", "sam", "dpadapter", "external")


def __getattr__(name: str):
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from dpadapter.upstream import base
    from dpadapter.upstream import basic as _basic  # noqa: F401  (registers scratch, standard)
    from dpadapter.upstream import control as _control  # noqa: F401  (registers control)
    from dpadapter.upstream import dpadapter as _dpadapter  # noqa: F401  (dpadapter, -ema)
    from dpadapter.upstream import external as _external  # noqa: F401  (registers external)
    from dpadapter.upstream import sam as _sam  # noqa: F401  (registers sam)

    rank = {f"{__name__}.{m}": i for i, m in enumerate(_METHOD_MODULES)}
    ordered = sorted(base.UPSTREAMS.items(), key=lambda kv: rank.get(kv[1].__module__, len(rank)))
    base.UPSTREAMS.clear()
    base.UPSTREAMS.update(ordered)
    globals().update({n: getattr(base, n) for n in __all__})  # later reads skip this function
    return globals()[name]
