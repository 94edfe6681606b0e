"""Whether the accountant is the installed code, right now: the gate of the process memo.

The process's memo of calibrations (`memo.sealed`) may hand one computation's sigma to every
later caller in the process, which in the test suite means to later tests. A test that stubs or
spies on the accountant (a `monkeypatch.setattr` on `_calibrate`, `_epsilon`, Opacus'
`_compute_rdp`, ...) must neither write its stub's value there nor be answered from there
(its stub would go uncalled). So the memo is read and written only while nothing on the path
from a target epsilon to a sigma is replaced:

- the privacy modules that calibrate (`accounting`, `calibration`) still bind every name to the
  object their own import bound it to (`record`, on each module's last line): any rebinding
  closes the memo, a spy that calls the original included;
- every function Opacus' accountant modules hold (module globals and their classes' attributes)
  is code from an installed package or the standard library, never from a file elsewhere (a
  test's lambda, a callable object, or a `functools.wraps` copy, whose code stays in the test's
  file). Opacus is checked by where its code lives rather than by identity because it is imported
  late (importing torch costs seconds), after a test could already have replaced something.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import sysconfig
from types import ModuleType

_MISSING = object()
# module name -> its names as its own import bound them
_AS_IMPORTED: dict[str, dict[str, object]] = {}
_ACCOUNTANTS = "opacus.accountants"


def record(namespace: dict[str, object]) -> None:
    """Remember what a module's names are bound to; call it on the module's last line."""
    _AS_IMPORTED[str(namespace["__name__"])] = dict(namespace)


def accountant_is_genuine() -> bool:
    """True while nothing the calibration computes through has been replaced (module doc)."""
    for name, bound in _AS_IMPORTED.items():
        live = vars(sys.modules[name])
        if any(live.get(k, _MISSING) is not v for k, v in bound.items()):
            return False
    return all(
        _installed(value)
        for name, module in list(sys.modules.items())
        if (name == _ACCOUNTANTS or name.startswith(_ACCOUNTANTS + ".")) and module is not None
        for value in _held(module)
    )


def _held(module: ModuleType):
    """The module's globals, and the attributes of the classes it defines."""
    for key, value in list(vars(module).items()):
        if key.startswith("__") or isinstance(value, ModuleType):
            continue
        yield value
        if inspect.isclass(value) and value.__module__ == module.__name__:
            yield from (v for k, v in vars(value).items() if not k.startswith("__"))


def _installed(value: object) -> bool:
    if isinstance(value, (staticmethod, classmethod)):
        value = value.__func__
    if isinstance(value, property):
        return all(_installed(f) for f in (value.fget, value.fset, value.fdel) if f is not None)
    if inspect.isfunction(value):
        return _installed_file(value.__code__.co_filename)
    if inspect.isclass(value) or not callable(value) or inspect.isbuiltin(value):
        return True
    # a callable object (functools' memo of `_compute_rdp`, or a test's stand-in): its type
    # and anything it wraps
    owner = sys.modules.get(type(value).__module__)
    if owner is not None and getattr(owner, "__file__", None):
        if not _installed_file(owner.__file__):
            return False
    wrapped = getattr(value, "__wrapped__", None)
    return wrapped is None or _installed(wrapped)


@functools.cache
def _installed_file(filename: str) -> bool:
    path = os.path.realpath(filename)
    return any(path.startswith(root + os.sep) for root in _roots())


@functools.cache
def _roots() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    return tuple(
        {os.path.realpath(paths[k]) for k in ("purelib", "platlib", "stdlib", "platstdlib")}
    )
