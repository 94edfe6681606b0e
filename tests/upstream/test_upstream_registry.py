"""Each upstream method is registered from the module named for it (one method family per file).

`dpadapter.upstream` imports the modules that register; a method moved to another file, or a
new one, must be placed here on purpose, and the shared step (`upstream.perturbed`) registers
nothing of its own.
"""

from __future__ import annotations

import importlib

import pytest

from dpadapter.upstream import UPSTREAMS

# registered name -> module of dpadapter.upstream that defines its class
HOME = {
    "scratch": "basic",
    "standard": "basic",
    "control": "control",
    "sam": "sam",
    "dpadapter": "dpadapter",
    "dpadapter-ema": "dpadapter",
    "external": "external",
}


def test_every_registered_method_has_a_home():
    assert set(UPSTREAMS) == set(HOME)


@pytest.mark.parametrize("name", sorted(UPSTREAMS))
def test_method_class_lives_in_its_module(name):
    cls = UPSTREAMS[name]
    module = importlib.import_module(f"dpadapter.upstream.{HOME[name]}")
    assert cls.__module__ == module.__name__
    assert getattr(module, cls.__name__) is cls
    assert cls.name == name


def test_the_shared_step_registers_nothing():
    assert not [n for n, c in UPSTREAMS.items() if c.__module__ == "dpadapter.upstream.perturbed"]


def test_registry_order_is_unchanged():
    """The config schema lists `pretrain.params` in registry order
    (dpadapter.validation.compose)."""
    order = ["scratch", "standard", "control", "sam", "dpadapter", "dpadapter-ema", "external"]
    assert list(UPSTREAMS) == order
