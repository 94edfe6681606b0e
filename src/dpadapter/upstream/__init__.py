from dpadapter.upstream import basic as _basic  # noqa: F401  (registers)
from dpadapter.upstream import control as _control  # noqa: F401  (registers)
from dpadapter.upstream import perturbed as _perturbed  # noqa: F401  (registers sam, dpadapter)
from dpadapter.upstream.base import UPSTREAMS, UpstreamContext, UpstreamMethod, register_upstream

__all__ = ["UPSTREAMS", "UpstreamContext", "UpstreamMethod", "register_upstream"]
