"""Opacus' RDP of the subsampled Gaussian at one order, memoised in this process.

Profiled (docs/speed.md), most of the time of a PRV epsilon is not the PRV convolution: it is
`compute_safe_domain_size`, which bounds the discretisation domain with Opacus' RDP accountant,
about 150 orders, each a Python series. It does so twice per evaluation for the same (q, sigma)
(the composed history, then each segment alone), again at every epoch of a run whose q and sigma
never change, and again for every calibration a process repeats. Opacus' `_compute_rdp(q,
sigma, alpha)` is a pure function of its three numbers, so its values are kept here, keyed by
the numbers and their types: the same floats come back, bit for bit, from one computation each
(tests/privacy/test_rdp_memo.py). Hand-written: Opacus keeps no such memo.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from types import ModuleType

# (q, sigma, alpha) triples: ~150 per sigma, a calibration visits ~30 sigmas
MAXSIZE = 1 << 16
_MARK = "_dpadapter_rdp_memo"
_bypassed = False


def install(analysis: ModuleType) -> bool:
    """Memoise `analysis._compute_rdp` (Opacus' `accountants/analysis/rdp.py`, which its
    `compute_rdp` looks up at each call) once; False, changing nothing, where the module has
    no such function (another Opacus: every value is then computed, slower but the same)."""
    original = getattr(analysis, "_compute_rdp", None)
    if _bypassed or not callable(original):
        return False
    if getattr(original, _MARK, False):
        return True
    memo = functools.lru_cache(maxsize=MAXSIZE, typed=True)(original)
    setattr(memo, _MARK, True)
    analysis._compute_rdp = memo
    return True


def info(analysis: ModuleType):
    """The memo's hit and miss counts (None where it is not installed)."""
    fn = getattr(analysis, "_compute_rdp", None)
    return fn.cache_info() if getattr(fn, _MARK, False) else None


@contextlib.contextmanager
def bypassed(analysis: ModuleType) -> Iterator[None]:
    """Opacus' own `_compute_rdp` for every value inside, and no memo installed meanwhile: what
    the code computed before the memo, for the comparisons that keep it honest (the tests and
    `bench/cpu/accountant_memo.py`). The memo, and what it holds, is back afterwards."""
    global _bypassed
    memo = getattr(analysis, "_compute_rdp", None)
    analysis._compute_rdp = getattr(memo, "__wrapped__", memo)
    _bypassed = True
    try:
        yield
    finally:
        analysis._compute_rdp = memo
        _bypassed = False
