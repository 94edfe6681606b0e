"""What MLflow may have written into the checkout's own results folder (the user's runs)."""

from __future__ import annotations

from pathlib import Path


def mlflow_footprint(repo: Path) -> dict[str, tuple[int, int]]:
    """(size, mtime) of the default store, its lock, the artifact folders and their first two
    levels (experiment, run): a run logged there adds or changes one of them."""
    paths = [*sorted((repo / "results").glob("mlruns.db*"))]
    for root in (repo / "results" / "mlartifacts", repo / "mlruns"):
        if root.is_dir():
            level1 = sorted(root.iterdir())
            paths += [
                root,
                *level1,
                *(p for d in level1 if d.is_dir() for p in sorted(d.iterdir())),
            ]
    out = {}
    for p in paths:
        st = p.stat()
        out[str(p.relative_to(repo))] = (st.st_size, st.st_mtime_ns)
    return out
