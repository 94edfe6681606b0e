"""bench/gpu/gpu_runs.py: DP-SAT Table 2 kept across short GPU loans (issue 44, item 2).

A finished cell comes back in a call's artifacts, is collected once into docs/gpu-runs/cells/,
and the next call skips it; the table in docs/gpu.md (and the README's line of it,
tools/readme_blocks.py) is generated from every collected cell and must not drift from them.
"""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest
from bench_scripts import import_bench

REPO = Path(__file__).resolve().parents[2]
FINISHED = REPO / "docs/gpu-runs/cells/dpsat-table2/dpsgd/eps3/seed0"
LOG = (
    "2026-11-28 18:55:53 [finetune scratch/fmnist/dpsgd/eps1/seed0] epoch 40/40 step 960/960 "
    "loss 0.7611 eps 0.997 sigma 4.6 elapsed 0:08:00 eta 0:00:00\n"
)


def _call(tmp: Path, *, dry: bool = False, epochs: int = 40, epsilon: float | None = None) -> Path:
    """A call's files as they come back: session.json and artifacts.tar.gz with one cell
    (DP-SGD at ε = 1, seed 0; with `epsilon`, a second one, DP-SAT, that records it)."""
    out = tmp / "out"
    out.mkdir()
    m = json.loads((FINISHED / "metrics.json").read_text())
    m["wildcards"].update(eps="1", seed="0")
    m["hyperparameters"]["epochs"] = epochs
    session = {"dry_run": dry, "options": ["--only", "table2"], "versions": {"card": "Card X"}}
    (out / "session.json").write_text(json.dumps(session))
    files = [
        ("table2/results/finetune/scratch/fmnist/dpsgd/eps1/seed0/metrics.json", json.dumps(m)),
        ("logs/table2-dpsgd-eps1-seed0.log", LOG),
    ]
    if epsilon is not None:
        edited = json.loads(json.dumps(m))
        edited["privacy"]["epsilon"] = epsilon
        path = "table2/results/finetune/scratch/fmnist/dpsat/eps3/seed1/metrics.json"
        files.append((path, json.dumps(edited)))
    with tarfile.open(out / "artifacts.tar.gz", "w:gz") as tar:
        for name, text in files:
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out


def test_a_collected_cell_is_kept_with_its_card_and_date_and_the_next_call_skips_it(tmp_path):
    runs, t2 = import_bench("gpu_runs"), import_bench("gpu_session_table2")
    done = tmp_path / "cells"
    assert ("dpsgd", 1.0, 0) in t2.queue(done)
    (dest,) = runs.collect(_call(tmp_path), "2026-12-01-x", "abc1234", done)
    assert dest == done / "dpsgd" / "eps1" / "seed0"
    run = json.loads((dest / "run.json").read_text())
    assert run["card"] == "Card X" and run["date"] == "2026-11-28" and run["commit"] == "abc1234"
    assert run["s_per_step"] == pytest.approx(480 / 960)
    assert "step 960/960" in (dest / "finetune.log").read_text()
    assert not list(dest.glob("*.pt"))  # never a checkpoint
    assert ("dpsgd", 1.0, 0) not in t2.queue(done)
    assert t2.queue(done)[0] == ("dpsgd", 3.0, 0)
    # collected once: the same call again is refused, and the cell is left as it was
    before = (dest / "metrics.json").read_text()
    with pytest.raises(SystemExit, match="collected once"):
        runs.collect(tmp_path / "out", "again", "def5678", done)
    assert (dest / "metrics.json").read_text() == before


@pytest.mark.parametrize(
    "what,why", [("dry", "dry run"), ("short", "not the paper's setting")], ids=["dry", "short"]
)
def test_a_dry_run_or_another_setting_is_not_collected(tmp_path, what, why):
    runs = import_bench("gpu_runs")
    out = _call(tmp_path, dry=what == "dry", epochs=2 if what == "short" else 40)
    with pytest.raises(SystemExit, match=why):
        runs.collect(out, "loan", "abc", tmp_path / "cells")
    assert not (tmp_path / "cells").exists()


def test_an_epsilon_that_is_not_the_accountants_refuses_the_whole_call(tmp_path):
    """A recorded epsilon is checked against the accountant over the cell's recorded releases;
    one edited cell refuses the call before any cell of it is written."""
    runs = import_bench("gpu_runs")
    recorded = json.loads((FINISHED / "metrics.json").read_text())["privacy"]["epsilon"]
    out = _call(tmp_path, epsilon=recorded - 0.5)
    with pytest.raises(SystemExit, match="not the accountant's"):
        runs.collect(out, "loan", "abc", tmp_path / "cells")
    assert not list((tmp_path / "cells").rglob("*.json"))


def test_the_table_in_the_gpu_doc_is_that_of_the_collected_cells():
    runs = import_bench("gpu_runs")
    assert runs.main(["table", "--check"]) == 0, "run: python bench/gpu/gpu_runs.py table"
    body = runs.render()
    for doc in runs.DOCS:
        assert body in doc.read_text()
    # every collected cell is a row, with its card and date
    for m in runs.DONE.glob("*/eps*/seed*/run.json"):
        run = json.loads(m.read_text())
        assert f"| {run['card']} | {run['date']} | {run['commit']} |" in body
