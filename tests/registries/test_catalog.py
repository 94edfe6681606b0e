"""The committed catalog.json is what the live registries give now; a stale one is never used.

The validation and the rule files read the registries through `dpadapter.registries.catalog` (no
torch);
if the manifest drifted from the classes, a config would be checked against schemas the jobs do
not use. CI fails here first, with the command that regenerates it.
"""

from __future__ import annotations

import json
import warnings

import pytest

from dpadapter.registries import catalog

COMMITTED = json.loads(catalog.MANIFEST.read_text())


@pytest.fixture(scope="module")
def live() -> dict:
    return catalog.build()


@pytest.mark.parametrize("section", ["sources_sha256", "algorithms", "upstreams", "models"])
def test_the_committed_manifest_is_what_the_registries_give(live, section):
    assert COMMITTED[section] == live[section], f"stale: run `{catalog.WRITE_COMMAND}`"


def test_the_manifest_is_read_in_registry_order(live):
    """The config schema's `pretrain.params` follows the registry's order."""
    from dpadapter.upstream import UPSTREAMS

    assert list(COMMITTED["upstreams"]) == list(UPSTREAMS)
    assert list(catalog.upstreams()) == list(UPSTREAMS)


def test_the_entries_carry_the_classes_facts():
    from dpadapter.algorithms import ALGORITHMS
    from dpadapter.models import MODEL_NAMES
    from dpadapter.upstream import UPSTREAMS

    assert catalog.algorithms()["dpsat"].params_schema == ALGORITHMS["dpsat"].params_schema
    up = catalog.upstreams()
    assert [n for n, e in up.items() if not e.needs_warmup] == ["scratch", "external"]
    assert [n for n, e in up.items() if e.sgd_schedule] == [
        n for n, c in UPSTREAMS.items() if hasattr(c, "sgd_config")
    ]
    assert {"sam", "dpadapter"} <= {n for n, e in up.items() if e.sgd_schedule}
    assert set(catalog.models()) == set(MODEL_NAMES)


def test_a_stale_manifest_falls_back_to_the_live_registries(tmp_path, monkeypatch, live):
    stale = {**COMMITTED, "sources_sha256": "0" * 64, "algorithms": {"ghost": {}}}
    path = tmp_path / "catalog.json"
    path.write_text(json.dumps(stale))
    monkeypatch.setattr(catalog, "MANIFEST", path)
    catalog._manifest.cache_clear()
    try:
        with pytest.warns(UserWarning, match="python -m dpadapter.registries.catalog --write"):
            assert set(catalog.algorithms()) == set(live["algorithms"])
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once a process
            catalog.upstreams()
    finally:
        catalog._manifest.cache_clear()


def test_an_edited_source_changes_the_digest(tmp_path, monkeypatch):
    for rel in catalog.SOURCES:
        src = catalog._PACKAGE / rel
        dst = tmp_path / rel
        if src.is_dir():
            for f in src.rglob("*.py"):
                (dst / f.relative_to(src)).parent.mkdir(parents=True, exist_ok=True)
                (dst / f.relative_to(src)).write_bytes(f.read_bytes())
        else:
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_bytes(src.read_bytes())
    monkeypatch.setattr(catalog, "_PACKAGE", tmp_path)
    assert catalog.sources_digest() == COMMITTED["sources_sha256"]
    with (tmp_path / "algorithms" / "dpsgd.py").open("a") as f:
        f.write("\n# edited\n")
    assert catalog.sources_digest() != COMMITTED["sources_sha256"]
    (tmp_path / "ground" / "param_schema.py").unlink()
    assert catalog.sources_digest() is None
