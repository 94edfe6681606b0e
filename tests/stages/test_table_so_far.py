"""The table so far (`table-so-far`): configs/dpsat-table2.yaml's table from the runs that have
finished, the others marked as cut (with the epoch they resume after) or not run yet.

The Snakemake path (a job cut by SIGTERM, the table between allocations, the resumed job) is
tests/cluster/test_table_over_allocations.py; here the runs' files are written by hand."""

import csv
import dataclasses
import json

import pytest
import torch

from dpadapter.settings import from_dict, load
from dpadapter.stages import table_so_far
from dpadapter.train.resume import resume_file_path

REPO = __import__("pathlib").Path(__file__).resolve().parents[2]


def _finish(cfg, algo, eps, seed, acc, up="scratch", task="fmnist"):
    """A finished run: its metrics.json as the job writes it (the keys the tables read)."""
    folder = table_so_far.run_folder(cfg, up, task, algo, eps, seed)
    folder.mkdir(parents=True)
    w = {"upstream": up, "task": task, "algo": algo, "eps": f"{eps:g}", "seed": str(seed)}
    m = {"wildcards": w, "test_accuracy": acc, "test_robust_accuracy": acc - 0.1,
         "privacy": {"epsilon": eps}}  # fmt: skip
    (folder / "metrics.json").write_text(json.dumps(m))


def _cut(cfg, algo, eps, seed, epoch):
    parts = ("scratch", "fmnist", algo, f"eps{eps:g}", f"seed{seed}")
    path = resume_file_path(cfg.results_dir, "finetune", *parts)
    path.parent.mkdir(parents=True)
    torch.save({"epoch": epoch, "model": {"w": torch.zeros(1000)}, "identity": "x"}, path)
    return path


def _row(md: str, eps: int) -> list[str]:
    line = next(x for x in md.splitlines() if x.startswith(f"| {eps} |"))
    return [c.strip() for c in line.strip("|").split("|")]


def test_table2_so_far_marks_cut_and_missing_cells_and_invents_nothing(tmp_path, capsys):
    cfg = load(REPO / "configs/dpsat-table2.yaml")
    cfg = dataclasses.replace(cfg, results_dir=str(tmp_path / "results"))
    for seed, acc in enumerate([0.84, 0.85, 0.86, 0.84, 0.85]):
        _finish(cfg, "dpsgd", 3, seed, acc)  # a whole cell
    _finish(cfg, "dpsat", 3, 0, 0.86)  # one seed of five; seed 1 cut
    _cut(cfg, "dpsat", 3, 1, 12)
    _cut(cfg, "dpsgd", 1, 0, 7)  # no seed finished, one cut
    _cut(cfg, "dpsam", 2, 4, 3).write_bytes(b"not a torch file")  # unreadable: starts over

    runs, md_path = table_so_far.run(cfg)
    md = md_path.read_text()
    assert "unreadable resume state" in capsys.readouterr().err
    assert "6 of 45 fine-tuning runs finished, 2 cut" in md and "37 not run yet" in md
    # ε = 3: dpsgd over its five seeds, dpsat over the one finished, beside the paper's
    assert _row(md, 3) == [
        "3", "84.55 ± 0.17", "84.80 ± 0.84 (5 seeds)", "80.68 ± 0.39", "not run yet",
        "85.91 ± 0.22", "86.00 ± 0.00 (1 of 5 seeds)", "8.80%", "7.89%",
    ]  # fmt: skip
    assert _row(md, 1)[1:3] == ["80.57 ± 0.25", "0 of 5 seeds (1 cut)"]
    assert _row(md, 2)[2] == "not run yet" and "nan" not in md.lower()
    assert "- `scratch` → `fmnist`, dpsat, ε = 3, seed 1: cut, resumes after epoch 12/40" in md
    assert "dpsam, ε = 2, seed 4: not run yet" in md
    # the CSVs: every run's status, and the finished cells aggregated as `aggregate` does
    out = tmp_path / "results" / "summary" / "so-far"
    status = {(r["algorithm"], r["epsilon"], r["seed"]): (r["status"], r["epoch"])
              for r in csv.DictReader(open(out / "runs.csv"))}  # fmt: skip
    assert len(status) == 45 and status[("dpsat", "3", "1")] == ("cut", "12")
    assert status[("dpsgd", "3", "4")] == ("finished", "")
    cells = list(csv.DictReader(open(out / "finetune.csv")))
    assert [(r["algorithm"], r["epsilon"], r["n_seeds"]) for r in cells] == [
        ("dpsat", "3", "1"),
        ("dpsgd", "3", "5"),
    ]
    assert [r["status"] for r in runs].count("finished") == 6


def test_without_a_reference_section_the_table1_layout_and_the_list(tiny_raw, tmp_path):
    tiny_raw["results_dir"] = str(tmp_path / "results")
    cfg = from_dict(tiny_raw)
    _finish(cfg, "dpsgd", 1.0, 0, 0.5, task="syn-same")
    _, md_path = table_so_far.run(cfg)
    md = md_path.read_text()
    assert md.startswith("# Fine-tuning: so far")
    assert "1 of 8 fine-tuning runs finished, 0 cut" in md and "| dpsgd | scratch |" in md
    assert md.count(": not run yet") == 7


@pytest.mark.parametrize("finished", [True, False])
def test_nothing_left(tiny_raw, tmp_path, finished):
    tiny_raw["results_dir"] = str(tmp_path / "results")
    tiny_raw["finetune"]["epsilons"] = [1]
    tiny_raw["pretrain"]["methods"] = ["scratch"]
    tiny_raw["tasks"].pop("syn-same")
    cfg = from_dict(tiny_raw)
    if finished:
        _finish(cfg, "dpsgd", 1.0, 0, 0.5, task="syn-shift")
    md = table_so_far.run(cfg)[1].read_text()
    assert ("None: every run of the grid has finished" in md) == finished
    assert ("No run finished." in md) == (not finished)
