"""The per-sample self-test once per architecture in a results folder, not once per job.

The self-test (`self_test.run_check`) looks for a per-sample mode that computes some layer's
per-example norms or clipped sums wrong: a closed form applied to a layout it does not cover, a
subclass whose forward changed, a grad sampler with a bug. Such a fault belongs to the code that
runs (the module classes and their configuration, the parameter shapes, which of them train,
the mode, the input's shape, the batch size that picks bk's code path, the device type), not
to the values the weights hold. The default grid fine-tunes 70 jobs on 5 checkpoints of one
architecture: the test ran 70 times on the same code, about 0.9 s of a 7 s job.

So a passed test is remembered in `<results_dir>/.cache/per_sample_check.json` under a key that
names all of the above, the source text of every module class in the model (a changed forward
is a new key), the source of `dpadapter.per_sample` itself and the versions of torch, Opacus
and timm; also what the source does not show: the parameters' layout (channels last), which of
them are tied (`shared`), each module's public plain settings (`extra_repr` shows some), and
the package's functions, defaults and plain-data settings as they stand in the process (a
threshold that picks a kernel, `conv.IM2COL_MAX_IN_CHANNELS`, changed at run time is a new key:
tests/per_sample/test_check_memo.py changes each input and sees the test run again).
A job whose key is there wraps its model without running the test again and records
the remembered result with `recalled: true`; any other job runs it and, when it passes, stores
it. A failed test is never stored (it raises). Weights are left out of the key on purpose: the
test's inputs are synthetic, and a weight-dependent disagreement is a kink of float rounding
(`self_test` module docstring), not a wrong mode. docs/privacy.md says what this leaves to
the first job of each key. Callers with no results folder (tests, bench scripts) pass no memo
and run the test every time.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib
import importlib.metadata
import inspect
import json
import sys
import types
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dpadapter.privacy.memo import lookup, remember

FILE = "per_sample_check.json"


def memo_path(results_dir: str | Path) -> str:
    return str(Path(results_dir) / ".cache" / FILE)


def run_or_recall(
    memo: str | Path | None,
    model: nn.Module,
    wrap: Callable[[], nn.Module],
    mode: str,
    sample_shape: Sequence[int],
    dtype: torch.dtype,
    examples: int | None,
    run: Callable[[], tuple[nn.Module, dict[str, Any]]],
) -> tuple[nn.Module, dict[str, Any]]:
    """`run()` (the self-test: (wrapped, record)), or `wrap()` and the record remembered under
    this model's key when an earlier job of the results folder passed it."""
    if memo is None:
        return run()
    key = signature(model, mode, sample_shape, dtype, examples)
    stored = lookup(memo, key)
    if isinstance(stored, dict) and stored.get("passed") is True:
        return wrap(), {**stored, "recalled": True, "memo_key": key}
    wrapped, record = run()
    if record.get("passed") is True:
        remember(memo, key, record)
    return wrapped, {**record, "recalled": False, "memo_key": key}


def signature(
    model: nn.Module,
    mode: str,
    sample_shape: Sequence[int],
    dtype: torch.dtype,
    examples: int | None,
) -> str:
    """sha256 of everything the self-test's verdict depends on, weights excepted."""
    device = next((p.device.type for p in model.parameters()), "cpu")
    modules = []
    for name, m in model.named_modules():
        cls = type(m)
        modules.append(
            {
                "name": name,
                "class": f"{cls.__module__}.{cls.__qualname__}",
                "source": _class_source_hash(cls),
                "config": m.extra_repr(),
                "settings": _settings(m),
                "training": m.training,
                "params": [
                    (n, tuple(p.shape), tuple(p.stride()), str(p.dtype), p.requires_grad)
                    for n, p in m.named_parameters(recurse=False)
                ],
                "buffers": [
                    (n, tuple(b.shape), tuple(b.stride()), str(b.dtype))
                    for n, b in m.named_buffers(recurse=False)
                    if b is not None
                ],
            }
        )
    what = {
        "tied": _tied(model),
        "mode": mode,
        "sample_shape": list(sample_shape),
        "dtype": str(dtype),
        "examples": examples,
        "device": device,
        "modules": modules,
        "code": _own_code_hash(),
        "live_code": _live_code_hash(model),
        "versions": _versions(),
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()


def _settings(m: nn.Module) -> dict[str, str]:
    """A module's public plain-data attributes (timm's `global_pool`, a flag its forward reads):
    configuration that `extra_repr` need not show. Not dicts (timm's `pretrained_cfg` names the
    checkpoint, which changes no code path) nor lists (state: Opacus' `activations`)."""
    return {
        k: _plain_bytes(v).decode()
        for k, v in sorted(vars(m).items())
        if not k.startswith("_") and k != "training" and _plain(v)
        if not isinstance(v, (dict, list))
    }


def _tied(model: nn.Module) -> list[list[str]]:
    """The names under which one parameter is held more than once (tied weights, a module
    registered twice): the same shapes tied or not are different models (`shared`)."""
    holders: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        holders.setdefault(id(p), []).append(name)
    return sorted(names for names in holders.values() if len(names) > 1)


def _plain(v: Any) -> bool:
    """Plain data whose repr is the same in every process: a setting, not an object."""
    if v is None or isinstance(v, (bool, int, float, str, bytes, torch.dtype)):
        return True
    if isinstance(v, (tuple, list, frozenset)):
        return all(_plain(x) for x in v)
    if isinstance(v, dict):
        return all(_plain(k) and _plain(x) for k, x in v.items())
    return False


def _plain_bytes(v: Any) -> bytes:
    if isinstance(v, frozenset):
        return b"{" + b",".join(sorted(_plain_bytes(x) for x in v)) + b"}"
    if isinstance(v, dict):
        return b"{" + b",".join(sorted(_plain_bytes((k, x)) for k, x in v.items())) + b"}"
    if isinstance(v, (tuple, list)):
        return b"(" + b",".join(_plain_bytes(x) for x in v) + b")"
    return f"{type(v).__name__}:{v!r}".encode()


@functools.cache
def _class_source_hash(cls: type) -> str:
    """The source files of the class and of every class it inherits from (a forward inherited
    from a changed parent is a change), hashed; torch's own classes by torch's version (in
    `_versions`), a class without a file by its name."""
    h = hashlib.sha256()
    for c in cls.__mro__:
        if c.__module__.partition(".")[0] in ("builtins", "torch"):
            continue
        h.update(f"{c.__module__}.{c.__qualname__}".encode())
        h.update(_file_hash(_source_file(c)).encode())
    return h.hexdigest()


def _source_file(c: type) -> str | None:
    try:
        return inspect.getsourcefile(c)
    except TypeError:  # a built-in class
        return None


@functools.cache
def _file_hash(path: str | None) -> str:
    if path is None:
        return "no source file"
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return f"unreadable: {path}"


def _package_files() -> list[Path]:
    return sorted(Path(__file__).parent.glob("*.py"))


@functools.cache
def _own_code_hash() -> str:
    """Every file of this package: the modes, their closed forms and the self-test itself."""
    h = hashlib.sha256()
    for f in _package_files():
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def _live_code_hash(model: nn.Module) -> str:
    """The code this process would run now: every function and method that the modules of
    this package hold (a function replaced at run time, as a test or a user's patch does, is
    a change the files do not show), and Opacus' grad sampler of each class in the model."""
    from opacus.grad_sample import GradSampleModule

    h = hashlib.sha256()
    package = __name__.rpartition(".")[0]
    # every module of the package, imported if it was not yet (the key must not depend on
    # which of them this process happened to have imported)
    names = [package] + [f"{package}.{f.stem}" for f in _package_files() if f.stem != "__init__"]
    for name in names:
        module = importlib.import_module(name)
        for attr, value in sorted(vars(module).items()):
            if attr.startswith("__"):  # its file's path, docstring, loader: not what runs
                continue
            h.update(f"{name}.{attr}".encode())
            h.update(_code_of(value))
    for cls in sorted({type(m) for m in model.modules()}, key=lambda c: c.__qualname__):
        h.update(cls.__qualname__.encode())
        h.update(_code_of(GradSampleModule.GRAD_SAMPLERS.get(cls)))
    return h.hexdigest()


def _code_of(value: Any) -> bytes:
    """The compiled code of a function (and its defaults), of a class's methods and settings,
    or of a registry's entries (a table from layer types to rules: `rules.RULES`); a module's
    or class's plain-data settings (`conv.PATCH_ELEMENTS`, `BookKeepingModule.fuse_norms`,
    `self_test.TOLERANCE`: a change at run time picks another path or verdict); nothing for
    other values (caches, tensors), nor for a library's own (`_from_a_library`)."""
    if _plain(value):
        return _plain_bytes(value)
    if _from_a_library(value):
        return b""
    if inspect.isfunction(value) or inspect.ismethod(value):
        defaults = (*(value.__defaults__ or ()), *sorted((value.__kwdefaults__ or {}).items()))
        return _code_bytes(value.__code__) + b"".join(
            _plain_bytes(d) if _plain(d) else type(d).__qualname__.encode() for d in defaults
        )
    if inspect.isclass(value):
        return b"".join(
            k.encode() + _code_of(v)
            for k, v in sorted(vars(value).items())
            if inspect.isfunction(v) or (not k.startswith("__") and _plain(v))
        )
    if isinstance(value, dict) and value and all(inspect.isclass(k) for k in value):
        return b"".join(
            k.__qualname__.encode() + _code_of(v)
            for k, v in sorted(value.items(), key=lambda kv: kv[0].__qualname__)
        )
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return b"".join(_code_of(getattr(value, f.name)) for f in dataclasses.fields(value))
    return b""


def _code_bytes(code: types.CodeType) -> bytes:
    """What a code object computes: its bytecode, names and constants, nested code objects
    included, line numbers left out. Not `marshal.dumps`: its output marks an object shared by
    reference depending on the object's reference count, so a function's bytes changed while a
    closure made from its nested code was alive elsewhere (a model wrapped earlier in the
    process: the memo then missed in the same process, seen 2026-11-28), and a frozenset
    constant's order follows the process's string hash seed."""
    fields = (
        code.co_code, code.co_names, code.co_varnames, code.co_freevars, code.co_cellvars,
        code.co_argcount, code.co_posonlyargcount, code.co_kwonlyargcount, code.co_flags,
    )  # fmt: skip
    return repr(fields).encode() + _constant_bytes(code.co_consts)


def _constant_bytes(c: Any) -> bytes:
    if isinstance(c, types.CodeType):
        return b"<code " + _code_bytes(c) + b">"
    if isinstance(c, tuple):
        return b"(" + b",".join(_constant_bytes(v) for v in c) + b")"
    if isinstance(c, frozenset):
        return b"{" + b",".join(sorted(_constant_bytes(v) for v in c)) + b"}"
    return f"{type(c).__name__}:{c!r}".encode()


def _from_a_library(value: Any) -> bool:
    """Defined by the standard library or an installed package (torch, Opacus: their versions
    are in the key), whose objects may change as they are used (a function swapped for its
    compiled twin, a class's lazily filled attributes): not this project's code, nor a patch."""
    name = str(getattr(value, "__module__", None) or "")
    if name.partition(".")[0] in sys.stdlib_module_names:
        return True
    file = str(getattr(sys.modules.get(name), "__file__", None) or "")
    return "site-packages" in file or "dist-packages" in file


@functools.cache
def _versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for dist in ("torch", "opacus", "timm"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    return out
