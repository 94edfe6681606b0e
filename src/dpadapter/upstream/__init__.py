# The import order is the registry's order, which the config schema's `pretrain.params` follows.
# isort: off
from dpadapter.upstream import basic as _basic  # noqa: F401  (registers scratch, standard)
from dpadapter.upstream import control as _control  # noqa: F401  (registers control)
from dpadapter.upstream import sam as _sam  # noqa: F401  (registers sam)
from dpadapter.upstream import dpadapter as _dpadapter  # noqa: F401  (dpadapter, dpadapter-ema)
from dpadapter.upstream import external as _external  # noqa: F401  (registers external)

# isort: on
from dpadapter.upstream.base import UPSTREAMS, UpstreamContext, UpstreamMethod, register_upstream

__all__ = ["UPSTREAMS", "UpstreamContext", "UpstreamMethod", "register_upstream"]
