"""What the dataset registry's declared counts say of a config's roles (nothing is loaded).

Read by the data's own checks (`dpadapter.data.checks`) and by the fine-tuning's privacy checks
(`dpadapter.stages.checks`: a delta against the smallest task).
"""

from __future__ import annotations

from dpadapter.data.registry import DATASET_INFO
from dpadapter.settings import Config, SplitConfig


def roles(cfg: Config) -> list[tuple[str, SplitConfig]]:
    """(key, split) of the public set and of each task, in config order."""
    return [("public", cfg.public)] + [(f"tasks.{n}", t) for n, t in cfg.tasks.items()]


def classes_of(split: SplitConfig) -> tuple[int, ...]:
    """The classes a role draws: its own list, else every class of its dataset."""
    return split.classes or tuple(range(DATASET_INFO[split.dataset].num_classes))


def task_sizes(cfg: Config) -> dict[str, int]:
    """Training examples of each task (an upper bound where n_train is null)."""
    out = {}
    for name, t in cfg.tasks.items():
        if t.dataset not in DATASET_INFO:
            continue
        info = DATASET_INFO[t.dataset]
        if any(c >= info.num_classes for c in t.classes or ()):
            continue
        counts = info.train_counts if t.train_split == "train" else info.test_counts
        # a source's own validation split takes nothing from the training pool
        n_val = 0 if info.val_counts is not None else t.n_val
        out[name] = t.n_train or sum(counts[c] for c in classes_of(t)) - n_val
    return out
