"""DVC and Snakemake on one results folder, with no manual step between them.

Two gaps, each closed here by hand (neither tool does it for the other):

- **Commit.** Snakemake builds the outputs, but `dvc push` only pushes what `dvc.lock` records:
  after a plain `snakemake` / `make run` it says "Everything is up to date" and pushes nothing.
  `commit` runs at the end of every successful Snakemake run (`onsuccess` in common.smk) and
  `dvc commit`s each DVC stage whose outputs lie under the results folder and were built or
  confirmed up to date by that run. Done inside the workflow rather than by routing `make run`
  through `dvc repro`, so it also holds for Slurm runs and for any config with a DVC stage file
  (`configs/paper/dvc.yaml`), and Snakemake keeps scheduling across stages in one DAG.
- **Pull.** `dvc pull` restores files with modification times in no particular order; Snakemake,
  which compares times, takes a pulled checkpoint restored before the one it was built from for
  outdated and re-trains it. `restore_build_order` runs before Snakemake builds its DAG: for each
  stage, in build order, whose outputs and upstream data are exactly what `dvc.lock` records
  (DVC's own content hashes), it gives the outputs a time after their upstream data. Outputs
  that differ from the lock (re-trained, edited, half-written) are left alone, so Snakemake
  still re-runs what really changed.

Nothing here runs where the working directory is no DVC project, and no commit inside
`dvc repro` (DVC_STAGE is set: DVC records the stage itself).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path


def active(workdir: str | Path = ".", in_repro: bool = False) -> bool:
    """A DVC project with a pipeline (and, unless `in_repro`, not a command of `dvc repro`)."""
    wd = Path(workdir)
    if not ((wd / ".dvc").is_dir() and (wd / "dvc.yaml").is_file()):
        return False
    return in_repro or "DVC_STAGE" not in os.environ


def _under(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def _files(path: Path) -> list[Path]:
    if path.is_dir():
        return [p for p in path.rglob("*") if p.is_file() and p.name != ".gitignore"]
    return [path] if path.is_file() else []


def _address(repo, stage) -> str:
    """The stage's name for the DVC command line run in the project root."""
    rel = os.path.relpath(stage.path, repo.root_dir)
    return stage.name if rel == "dvc.yaml" else f"{rel}:{stage.name}"


def _stages(repo, results: Path) -> list:
    """DVC stages whose every output lies under `results`, in build order."""
    import networkx as nx

    graph = repo.index.graph  # edges run from a stage to the stages it depends on
    own = [s for s in graph if s.outs and all(_under(Path(o.fs_path), results) for o in s.outs)]
    return list(reversed(list(nx.topological_sort(graph.subgraph(own)))))


def restore_build_order(results_dir: str | Path, workdir: str | Path = ".") -> list[str]:
    """Re-time pulled outputs that match dvc.lock into build order; return the stages done.

    Also inside `dvc repro` (a stage's Snakemake run would otherwise re-train pulled upstream
    checkpoints). Never fails the workflow: on any error it warns and leaves the times alone.
    """
    if not active(workdir, in_repro=True):
        return []
    try:
        return _restore_build_order(results_dir, workdir)
    except Exception as exc:  # noqa: BLE001 (a convenience; Snakemake decides without it)
        print(f"warning: could not check pulled outputs against dvc.lock: {exc}", file=sys.stderr)
        return []


def _restore_build_order(results_dir: str | Path, workdir: str | Path) -> list[str]:
    results = Path(workdir, results_dir).resolve()
    if not results.is_dir():
        return []
    from dvc.repo import Repo

    done: list[str] = []
    with Repo(str(Path(workdir).resolve())) as repo:
        for stage in _stages(repo, results):
            outs = [f for o in stage.outs for f in _files(Path(o.fs_path))]
            data = [d for d in stage.deps if _under(Path(d.fs_path), results)]
            inputs = [f for d in data for f in _files(Path(d.fs_path))]
            if not outs or not inputs:
                continue
            newest_input = max(f.stat().st_mtime for f in inputs)
            if min(f.stat().st_mtime for f in outs) > newest_input:
                continue  # already in build order
            if any(o.workspace_status() for o in [*stage.outs, *data]):
                continue  # not what the lock recorded: let Snakemake decide
            t = max(time.time(), newest_input + 1.0)
            for f in outs:
                os.utime(f, (t, t))
            done.append(_address(repo, stage))
    if done:
        print(
            f"dvc: outputs of {', '.join(done)} match dvc.lock; set their times after their "
            "inputs' (pulled files come back in no particular order)",
            file=sys.stderr,
        )
    return done


def commit(
    results_dir: str | Path, produced: Iterable[str], workdir: str | Path = "."
) -> list[str]:
    """`dvc commit` the stages under `results_dir` whose outputs `produced` covers.

    `produced`: the output files of every job in the finished Snakemake DAG, all of them built
    or found up to date by that run. A file output must be one of them; a folder output must
    hold at least one (a folder may also hold outputs of other targets, e.g. the sweeps).
    """
    if not active(workdir):
        return []
    results = Path(workdir, results_dir).resolve()
    made = {Path(workdir, p).resolve() for p in produced}
    from dvc.repo import Repo

    with Repo(str(Path(workdir).resolve())) as repo:
        stages = []
        for stage in _stages(repo, results):
            ok = True
            for o in stage.outs:
                p = Path(o.fs_path)
                if p.is_dir():
                    ok &= any(_under(m, p) for m in made)
                else:
                    ok &= p in made and p.is_file()
            if ok:
                stages.append(_address(repo, stage))
    if not stages:
        return []
    r = subprocess.run(
        [sys.executable, "-m", "dvc", "commit", "--force", *stages],
        cwd=workdir,
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        # The results stay; only their record is missing. Say how to make it by hand.
        print(
            f"warning: `dvc commit` failed ({r.returncode}); run `dvc commit {' '.join(stages)}` "
            f"before `dvc push`:\n{(r.stdout + r.stderr)[-2000:]}",
            file=sys.stderr,
        )
        return []
    print(f"dvc: committed {', '.join(stages)} to dvc.lock (`dvc push` uploads them)")
    return stages
