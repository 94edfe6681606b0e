"""tools/readme_blocks.py: every figure on the front page is written from a committed record of
the run that measured it, and the record is of the code as it is now (issue 70).

In-process: the repository's trees are read with dulwich, no git process.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "tools" / "readme_blocks.py"
_spec = importlib.util.spec_from_file_location("readme_blocks", _PATH)
rb = importlib.util.module_from_spec(_spec)
sys.modules["readme_blocks"] = rb  # its dataclasses look their module up while defined
_spec.loader.exec_module(rb)


def _copy_records(tmp: Path) -> Path:
    root = tmp / "records"
    shutil.copytree(rb.RECORDS, root)
    return root


def _newest_run(root: Path) -> Path:
    return rb.records("make-run", root)[0].folder


def test_every_block_on_the_front_page_is_what_its_records_render():
    assert rb.problems() == [], "run: python tools/readme_blocks.py"


def test_the_records_are_of_the_code_as_it_is_now():
    """A record is current when the trees of the paths it measures are HEAD's (not its commit:
    that holds on a shallow clone and after a rebase). Where no repository can be read, the
    test says so instead of passing silently."""
    try:
        found = rb.stale_records()
    except rb.CannotTell as e:
        pytest.skip(f"cannot tell whether the records are current: {e}")
    assert found == []


def test_the_dpadapter_sentence_is_the_paired_row_make_run_printed():
    r = rb.records("make-run")[0]
    row = next(
        line
        for line in r.printed().splitlines()
        if line.startswith("| dpadapter − standard | dpsgd |")
    )
    std = rb.paired(r.printed(), "dpadapter", "standard")
    assert row.endswith(
        f"**{std['estimate']}** [{std['low']}, {std['high']}] | {std['detectable']} |"
    )
    readme = rb.README.read_text()
    assert (
        f"DPAdapter − standard is {std['estimate']} points [{std['low']}, {std['high']}], "
        f"detectable from {std['detectable']}"
    ) in readme
    assert r.short in readme and r.date in readme


def test_the_table1_sentence_is_each_algorithms_answer_as_the_overlay_printed_it():
    """Issue 67: one README sentence answers, per algorithm, whether DPAdapter helps, with the
    interval and the detectable difference beside the paper's effect, from the overlay's record."""
    r = rb.records("table1")[0]
    text = r.printed()
    readme = rb.README.read_text()
    rows = [c for c in rb._table_after(text, rb.TABLE1_LEAD)
            if c["comparison"] == "dpadapter − standard"]  # fmt: skip
    assert {c["algorithm"] for c in rows} >= {"DP-SGD", "AdpClip", "GEP", "AdpAlloc"}
    for c in rows:
        line = next(s for s in text.splitlines() if s.startswith(f"- {c['algorithm']}: **"))
        verdict = line.split("**")[1]
        ours = c["ours [95 % CI]"].replace("-", "−")
        assert f"{c['algorithm']}: {verdict} ({ours}, detectable {c['detectable']}" in readme
    assert r.short in readme and r.date in readme


def test_an_algorithm_without_its_answer_line_is_refused(tmp_path):
    root = _copy_records(tmp_path)
    folder = rb.records("table1", root)[0].folder
    printed = folder / "printed.md"
    printed.write_text(printed.read_text().replace("- GEP: **", "- GEP: "))
    with pytest.raises(ValueError, match="no answer line for GEP"):
        rb.render_table1(rb.latest(("table1",), root))


def test_a_figure_edited_by_hand_fails(tmp_path):
    page = tmp_path / "README.md"
    text = rb.README.read_text()
    std = rb.paired(rb.records("make-run")[0].printed(), "dpadapter", "standard")
    edited = text.replace(f"is {std['estimate']} points", "is +9.9 points", 1)
    assert edited != text
    page.write_text(edited)
    blocks = [dataclasses.replace(b, page=page) for b in rb.BLOCKS]
    assert rb.problems(blocks) == [f"{page}: block make-run is not its records'"]
    page.write_text(text)
    assert rb.problems(blocks) == []


def test_a_newer_record_that_prints_another_answer_makes_the_block_stale(tmp_path):
    root = _copy_records(tmp_path)
    old = _newest_run(root)
    new = old.parent / "9999-12-31-fffffff"
    shutil.copytree(old, new)
    data = json.loads((new / "record.json").read_text())
    data.update(date="9999-12-31", commit="f" * 40)
    (new / "record.json").write_text(json.dumps(data))
    printed = (new / "printed.md").read_text()
    std = rb.paired(printed, "dpadapter", "standard")
    (new / "printed.md").write_text(printed.replace(f"**{std['estimate']}**", "**+9.9**", 1))
    assert rb.latest(("make-run",), root)["make-run"].commit == "f" * 40
    assert rb.problems(root=root) == ["README.md: block make-run is not its records'"]


def test_a_record_older_than_the_code_it_measures_is_stale(tmp_path):
    root = _copy_records(tmp_path)
    r = rb.records("make-run", root)[0]
    head = dict(r.trees)
    assert rb.stale(r, head) is None
    head["src"] = "0" * 40  # src/ changed since the run
    why = rb.stale(r, head)
    assert why is not None and "src" in why and r.short in why and r.command in why
    assert why in rb.stale_records(root=root, head=head)  # and make-run-time: the same paths


def test_a_record_names_its_date_commit_machine_and_command(tmp_path):
    folder = tmp_path / "r"
    folder.mkdir()
    good = {"kind": "make-run", "date": "2026-11-29", "time": "06:00", "commit": "a" * 40,
            "machine": "vm", "command": "make run", "figures": {}, "trees": {}}  # fmt: skip
    (folder / "record.json").write_text(json.dumps(good))
    assert rb.load(folder).short == "aaaaaaa"
    for key, bad in [("date", "yesterday"), ("commit", "HEAD"), ("machine", "")]:
        (folder / "record.json").write_text(json.dumps({**good, key: bad}))
        with pytest.raises(ValueError, match=key):
            rb.load(folder)


def test_outside_a_repository_it_cannot_tell(tmp_path):
    with pytest.raises(rb.CannotTell):
        rb.trees(("src",), repo=tmp_path)


@pytest.mark.parametrize("block", rb.BLOCKS, ids=lambda b: b.name)
def test_each_block_has_one_pair_of_markers_in_its_page(block):
    text = block.page.read_text()
    assert text.count(f"<!-- {block.name}:begin -->") == 1
    assert text.count(f"<!-- {block.name}:end -->") == 1


@pytest.mark.parametrize("kind", [k for k in rb.KINDS.values() if k.measures], ids=lambda k: k.name)
def test_each_record_carries_the_trees_its_kind_measures(kind):
    found = rb.records(kind.name)
    assert found, f"no {kind.name} record"
    for r in found:
        assert set(r.trees) == set(kind.measures), r.folder
        assert all(len(t) == 40 for t in r.trees.values()), r.folder
