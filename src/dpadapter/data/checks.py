"""The data's own checks of a config, from the registry's declared counts (nothing loaded).

Dataset names against the registry (a `<family>:<spec>` name registered from what `data.root`
holds now), class ids against each dataset's classes, what the roles drawn from one source ask
of its pools, the channels each role reaches the model with, and (the workflow's
`check_files`) whether each dataset's files are where the loader looks. Each problem is a
`key: text` line (`dpadapter.settings.errors`); `dpadapter.validation.compose` composes them.
"""

from __future__ import annotations

import itertools

from dpadapter.data.registry import DATASET_INFO, family_of, missing_files, resolve_dataset
from dpadapter.data.sizes import classes_of, roles
from dpadapter.settings import Config, SplitConfig

# Subsets of roles drawn from one source whose joint demand is checked (2^k of them).
_MAX_ROLES_FOR_SUBSETS = 10


def family_problems(cfg: Config, check_files: bool) -> list[str]:
    """Datasets named `<family>:<spec>` (imagefolder:<path>@<side>) are registered from what
    `data.root` holds now (their class counts), or reported with the path they lack (only
    with `check_files`, as any dataset's files: without, their counts go unchecked)."""
    out, seen = [], set()
    for where, split in roles(cfg):
        if split.dataset not in seen:
            seen.add(split.dataset)
            problem = resolve_dataset(
                split.dataset, cfg.data.root, missing_ok=not check_files, fresh=True
            )
            if problem:
                out.append(f"{where}.dataset: {problem}")
    return out


def name_problems(cfg: Config) -> list[str]:
    """Each role's dataset must be registered, or be a family's `<prefix>:<spec>`."""
    return [
        f"{where}.dataset: unknown dataset {split.dataset!r}; known: {sorted(DATASET_INFO)}"
        for where, split in roles(cfg)
        if split.dataset not in DATASET_INFO and family_of(split.dataset) is None
    ]


def data_problems(cfg: Config) -> list[str]:
    """Class ids, the pools the roles share, and the channels each role reaches the model with."""
    out = []
    known = [(w, s) for w, s in roles(cfg) if s.dataset in DATASET_INFO]
    ok_roles = []
    for where, split in known:
        k = DATASET_INFO[split.dataset].num_classes
        bad = [c for c in split.classes or () if c >= k]
        if bad:
            out.append(
                f"{where}.classes: {bad} out of range: {split.dataset} has classes 0..{k - 1}"
            )
        else:
            ok_roles.append((where, split))
    # The public set and the tasks draw disjointly from each source's train (n_train + n_val)
    # and test (n_test) pools, in config order; a null size takes what is left (at least one).
    # A source with a validation split of its own gives each role all of that split's examples
    # of its classes, and n_val nothing from train.
    for dataset in dict.fromkeys(s.dataset for _, s in ok_roles):
        group = [(w, s) for w, s in ok_roles if s.dataset == dataset]
        info = DATASET_INFO[dataset]
        own_val = info.val_counts is not None
        out += _val_split_problems(group, info.val_counts) if own_val else []
        pools = [
            ("train", info.train_counts, "n_train" if own_val else "n_train + n_val"),
            ("test", info.test_counts, "n_test"),
        ]
        if own_val:
            pools.append(("val", info.val_counts, "n_val"))
        for pool, counts, what in pools:
            # A role may draw its training or test examples from the other split of the
            # source (`train_split` / `test_split`): count what each role takes from this one.
            def demand(s, pool=pool, counts=counts, own_val=own_val):
                if pool == "val":
                    return sum(counts[c] for c in classes_of(s))
                n_val = 0 if own_val else s.n_val
                need = (s.n_train or 1) + n_val if s.train_split == pool else 0
                return need + ((s.n_test or 1) if s.test_split == pool else 0)

            members = [(w, s) for w, s in group if demand(s)]
            out += _pool_problems(members, pool, counts, demand, what, dataset)
    return out + _channel_problems(known)


def _val_split_problems(group: list[tuple[str, SplitConfig]], val_counts) -> list[str]:
    """With the source's own validation split, a role's n_val is 0 (absent) or the number of
    that split's examples of its classes: the split is used whole, never carved or topped up
    from train, so any other number is a misunderstanding refused before any job."""
    out = []
    for where, split in group:
        have = sum(val_counts[c] for c in classes_of(split))
        if split.n_val not in (0, have):
            out.append(
                f"{where}.n_val: {split.n_val}, but {split.dataset} has a validation split of "
                f"its own (val/ or validation/ beside test/) with {have} example(s) of its "
                f"classes, used whole as its validation set; drop n_val (or set it to {have}), "
                "or move val/'s images into train/ to carve n_val from there"
            )
    return out


def _channel_problems(known: list[tuple[str, SplitConfig]]) -> list[str]:
    """Every role must reach the model with the public set's channels (one model for all).

    The rule (docs/your-data.md): a role's images keep their own channels (a grey image folder
    is 1-channel, the default's grey upstreams take it as it is); `channels` on a role converts,
    1 -> 3 by replicating the grey value, 3 -> 1 by luminance (PIL's L = 0.299 R + 0.587 G +
    0.114 B). A mismatch is refused naming both fixes, the role's `channels` first: changing
    `public.channels` retrains the warm-up."""

    def channels(split: SplitConfig) -> int | None:
        own = DATASET_INFO[split.dataset].channels
        return own if own is None or split.channels is None else split.channels

    out, public = [], None
    for where, split in known:
        c = channels(split)
        if where == "public":
            public = c
        elif c is not None and public is not None and c != public:
            own = DATASET_INFO[split.dataset].channels
            how = "replicated" if c == 1 else "converted to grey by luminance"
            kind = "grey" if c == 1 else "colour"
            instead = "" if own == c else f" instead of {c}"
            out.append(
                f"{where}: {split.dataset} gives {c}-channel images ({kind}), the public set "
                f"{public}-channel ones; set {where}.channels: {public} (its images {how})"
                f"{instead}, or public.channels: {c} (retrains the warm-up and every upstream)"
            )
    return out


def _pool_problems(group, pool, counts, demand, what, dataset) -> list[str]:
    """Sets of roles asking for more examples of their classes than the pool holds.

    Every set of roles sharing the pool is checked (the smallest failing ones are reported):
    k roles needing n_1..n_k examples of the union U of their classes fit only if
    sum n_i <= |pool restricted to U|. This is necessary; whether the random draw leaves
    enough of one class for a later role is known only when the job allocates.
    """
    out: list[str] = []
    failed: list[frozenset[int]] = []
    sizes = range(1, len(group) + 1)
    if len(group) > _MAX_ROLES_FOR_SUBSETS:
        sizes = [1, len(group)]
    for r in sizes:
        for subset in itertools.combinations(range(len(group)), r):
            if any(f <= set(subset) for f in failed):
                continue
            classes = sorted({c for i in subset for c in classes_of(group[i][1])})
            have = sum(counts[c] for c in classes)
            need = sum(demand(group[i][1]) for i in subset)
            if need > have:
                failed.append(frozenset(subset))
                names = " + ".join(group[i][0] for i in subset)
                out.append(
                    f"{group[subset[-1]][0]}.{what.split(' ')[0]}: {names} ask for {need} "
                    f"{pool} examples ({what}) of {dataset} classes {classes}, which has "
                    f"{have} (they draw disjointly from one pool)"
                )
    return out


def file_problems(cfg: Config) -> list[str]:
    """Each dataset whose files the loader will not find, with the loader's own message."""
    out = []
    seen: set[str] = set()
    for where, split in roles(cfg):
        if split.dataset in seen or split.dataset not in DATASET_INFO:
            continue
        seen.add(split.dataset)
        msg = missing_files(split.dataset, cfg.data.root, cfg.data.download)
        if msg:
            out.append(f"{where}.dataset: {msg}")
    return out
