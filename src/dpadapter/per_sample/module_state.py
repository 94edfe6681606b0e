"""A module's state besides its parameters: buffers, and tensors kept as plain attributes.

The checks before private training call modules on synthetic batches and must leave them as
they found them; and a module that keeps something computed from its inputs between calls
learns from private data outside the accounting, whether it registered a buffer
(`running_mean`) or just assigned a tensor (`self.last = x.mean(0)`). Both are snapshotted
here, restored after each call, and compared: the buffers as torch registers them, the plain
attributes as the tensors found in the module's own `__dict__` (directly, or in a list, tuple
or dict there), the internals every `nn.Module` has left out.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

# the hook registries of a module: a per-sample mode's recording lives there
_HOOKS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
)
# what every nn.Module keeps in its __dict__ (hooks, the registries of parameters, buffers and
# submodules, the training flag): not state a forward could learn into
_INTERNALS = frozenset(vars(nn.Module()))


def snapshot_buffers(m: nn.Module) -> list[tuple[nn.Module, str, torch.Tensor, torch.Tensor]]:
    """Every buffer of `m` and its submodules, with a copy of its values (`restore_buffers`)."""
    return [
        (mod, k, t, t.detach().clone())
        for mod in m.modules()
        for k, t in mod._buffers.items()
        if t is not None
    ]


def restore_buffers(snap) -> dict[nn.Module, list[str]]:
    """Put every buffer back (object and values); return those that had changed, by module."""
    changed: dict[nn.Module, list[str]] = {}
    for mod, k, t, saved in snap:
        now = mod._buffers.get(k)
        if now is not t or not same(t, saved):
            changed.setdefault(mod, []).append(k)
            mod._buffers[k] = t
            t.copy_(saved)
    return changed


def _state_attributes(mod: nn.Module) -> dict[str, Any]:
    """The module's own attributes that hold or may come to hold tensors: a tensor, None, or a
    list, tuple or dict (a cache filled on the first call starts empty)."""
    return {
        k: v
        for k, v in vars(mod).items()
        if k not in _INTERNALS and (v is None or isinstance(v, torch.Tensor | list | tuple | dict))
    }


def _leaves(v: Any) -> list:
    if torch.is_tensor(v):
        return [v]
    if isinstance(v, list | tuple | dict):
        return tree_leaves(v)
    return []


def _values(v: Any) -> list:
    return [t.detach().clone() if torch.is_tensor(t) else t for t in _leaves(v)]


def _shallow(v: Any) -> Any:
    return dict(v) if isinstance(v, dict) else list(v) if isinstance(v, list) else None


def snapshot_attributes(m: nn.Module) -> dict[nn.Module, dict[str, tuple]]:
    """Each module's state attributes: the object, a shallow copy of a list or dict (filled in
    place by a call), and a copy of the tensors' values (changed in place)."""
    return {
        mod: {k: (v, _shallow(v), _values(v)) for k, v in _state_attributes(mod).items()}
        for mod in m.modules()
    }


def attribute_values(m: nn.Module) -> dict[tuple[int, str], list]:
    """The tensors every state attribute of `m`'s modules holds now, by value: two calls on
    different inputs that leave different values kept something computed from them."""
    return {
        (id(mod), k): _values(v) for mod in m.modules() for k, v in _state_attributes(mod).items()
    }


def restore_attributes(snap) -> None:
    """Put every state attribute back as it was before the call: the object, a list's or
    dict's contents, tensors' values; one the call added is removed."""
    for mod, before in snap.items():
        for k in _state_attributes(mod).keys() - before.keys():
            delattr(mod, k)
        for k, (obj, shallow, saved) in before.items():
            vars(mod)[k] = obj
            if isinstance(obj, dict):
                obj.clear()
                obj.update(shallow)
            elif isinstance(obj, list):
                obj[:] = shallow
            for t, s in zip(_leaves(obj), saved, strict=False):
                if torch.is_tensor(t) and torch.is_tensor(s) and t.shape == s.shape:
                    with torch.no_grad():
                        t.copy_(s)


def same_values(a: list, b: list) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if torch.is_tensor(x) != torch.is_tensor(y):
            return False
        if torch.is_tensor(x) and (x.shape != y.shape or x.dtype != y.dtype or not same(x, y)):
            return False
    return True


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.is_floating_point() or a.is_complex():
        return bool(((a == b) | (a.isnan() & b.isnan())).all())
    return torch.equal(a, b)


@contextmanager
def hooks_suspended(m: nn.Module) -> Iterator[None]:
    """Inside, `m` and its submodules run without the hooks registered on them (a wrapped
    model's per-sample recording: a check's calls with gradients must not feed it); after,
    the hooks as they were, and any registered inside gone."""
    saved = []
    for mod in m.modules():
        saved.append((mod, {k: vars(mod)[k] for k in _HOOKS if k in vars(mod)}))
        for k in saved[-1][1]:
            vars(mod)[k] = OrderedDict()
    try:
        yield
    finally:
        for mod, hooks in saved:
            vars(mod).update(hooks)
