from dpadapter.upstream import basic as _basic  # noqa: F401  (registers)
from dpadapter.upstream.base import UPSTREAMS, UpstreamContext, UpstreamMethod, register_upstream

__all__ = ["UPSTREAMS", "UpstreamContext", "UpstreamMethod", "register_upstream"]
