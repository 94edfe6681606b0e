"""docs/architecture.md says what tests/test_import_layers.py enforces, so the page cannot drift.

The layer table of the page must list every package of `LAYERS` in its layer and nothing else;
the page must name every rule file and every stage `python -m dpadapter` accepts. `LAYERS` is
read from the layer test itself (one definition), loaded by path: tests/ is not a package.
"""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"

_spec = importlib.util.spec_from_file_location(
    "_import_layers", ROOT / "tests" / "test_import_layers.py"
)
_layers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_layers)
LAYERS: dict[str, int] = _layers.LAYERS

_ROW = re.compile(r"^\|\s*(\d+)\s*\|([^|]*)\|")


def layer_table(text: str) -> dict[str, int]:
    """package -> layer, from the rows of the table under `## Layers` (first two columns)."""
    section = text.split("\n## Layers", 1)[1].split("\n## ", 1)[0]
    table: dict[str, int] = {}
    for line in section.splitlines():
        m = _ROW.match(line)
        if not m:
            continue
        for name in re.findall(r"`([^`]+)`", m.group(2)):
            if name in table:
                raise ValueError(f"{name} is in two rows of the layer table")
            table[name] = int(m.group(1))
    return table


def cli_stages(cli: Path = ROOT / "src" / "dpadapter" / "launch" / "cli.py") -> set[str]:
    """The names of the subcommands `main` registers with `sub.add_parser(...)`."""
    names = set()
    for node in ast.walk(ast.parse(cli.read_text())):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "add_parser"
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "sub"
        ):
            names.add(node.args[0].value)
    return names


@pytest.fixture(scope="module")
def text() -> str:
    return DOC.read_text()


def test_the_layer_table_is_the_enforced_one(text):
    assert layer_table(text) == LAYERS


def test_every_rule_file_and_stage_is_on_the_page(text):
    rule_files = sorted(p.name for p in (ROOT / "workflow" / "rules").glob("*.smk"))
    assert [f for f in rule_files if f not in text] == []
    stages = cli_stages() - {"validate"}
    assert stages >= {"warmup", "finetune", "hpo", "audit"}  # the parser was read
    assert sorted(s for s in stages if f"`{s}`" not in text and f'|"{s}"|' not in text) == []


@pytest.mark.parametrize(
    "old, new",
    [
        ("| 3 | `dpadapter.algorithms` |", "| 4 | `dpadapter.algorithms` |"),  # moved
        (", `dpadapter.tracking` |", " |"),  # left out
        ("| 2 | `dpadapter.per_sample` |", "| 2 | `dpadapter.per_sample`, `x.y` |"),
    ],
)
def test_a_drifted_table_is_caught(text, old, new):
    assert old in text
    assert layer_table(text.replace(old, new)) != LAYERS
