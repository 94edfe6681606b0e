"""tools/schema_docs.py: the option tables in docs/ are the schema's, every key is in one, and a
table that has drifted from the schema (a key moved, a default changed) fails here, not in a
reader's run."""

import importlib.util
import sys
from pathlib import Path

import pytest

from dpadapter.validation.compose import full_schema

_PATH = Path(__file__).resolve().parents[2] / "tools" / "schema_docs.py"
_spec = importlib.util.spec_from_file_location("schema_docs", _PATH)
schema_docs = importlib.util.module_from_spec(_spec)
sys.modules["schema_docs"] = schema_docs  # its dataclass looks its module up while defined
_spec.loader.exec_module(schema_docs)


@pytest.fixture(scope="module")
def rows():
    return schema_docs.rows()


@pytest.fixture(scope="module")
def texts():
    return {p: p.read_text() for p in schema_docs.doc_files()}


def test_the_tables_in_docs_are_up_to_date_and_cover_every_key(texts, rows):
    found = schema_docs.problems(texts, rows)
    assert not found, "\n".join(found) + "\nrun: python tools/schema_docs.py"


def test_every_schema_key_is_written_in_some_doc(texts, rows):
    """Independently of the region logic: each key's row text is in a doc."""
    docs = "".join(texts.values())
    schema = full_schema()
    for key in schema["properties"]:
        assert f"| `{key}` |" in docs, key
    missing = [r.path for r in rows if f"| `{r.path}` |" not in docs]
    assert not missing, missing


def test_a_key_in_no_table_is_named(texts, rows):
    without = {
        p: t.replace("<!-- options:begin sweeps -->", "<!-- gone -->") for p, t in texts.items()
    }
    found = "\n".join(schema_docs.problems(without, rows))
    assert "config key sweeps.gammas is in no options table" in found, found


def test_a_stale_table_is_named(texts, rows):
    path = next(p for p, t in texts.items() if "<!-- options:begin hpo -->" in t)
    stale = dict(texts)
    row = "| `hpo.grid_size` | integer | `8` |"
    stale[path] = texts[path].replace(row, row.replace("`8`", "`9`"))
    assert stale[path] != texts[path]
    found = "\n".join(schema_docs.problems(stale, rows))
    assert f"{path.name}: options table(s) hpo out of date" in found, found
    assert schema_docs.render(stale, rows)[path] == texts[path]  # regenerating mends it


def test_a_new_schema_key_makes_the_tables_stale(texts):
    schema = full_schema()
    schema["properties"]["privacy"]["properties"]["new_knob"] = {
        "type": "integer",
        "minimum": 1,
        "description": "a knob the docs do not have yet",
    }
    found = "\n".join(schema_docs.problems(texts, schema_docs.rows(schema)))
    assert "options table(s) privacy out of date" in found, found


def test_a_row_renders_type_default_allowed_and_description(rows):
    by_path = {r.path: r for r in rows}
    r = by_path["finetune.grad_sample_mode"]
    assert (r.type, r.default, r.allowed) == ("string", "`bk`", "`bk`, `hooks`, `functorch`, `ew`")
    r = by_path["privacy.delta"]
    assert (r.default, r.allowed) == ("`1e-05`", "(0, 1)")
    assert by_path["public.dataset"].default == "required"
    assert by_path["tasks.<name>.n_train"].type == "integer or null"
    assert by_path["finetune.extra_grids[].algorithms"].default == "required"
    assert by_path["pretrain.params.dpadapter.m1"].default == "`5000`"
    assert "\\|" in by_path["device"].allowed  # a pipe would end the table cell
