"""Dirichlet-alpha label split of a private task across simulated clients (Hsu et al. 2019).

For each class, the class's examples (in a seeded random order) are cut into N consecutive
chunks with proportions drawn from Dir(alpha * 1_N); client i gets the i-th chunk of every class.
Every example therefore lands in exactly one client (a partition). Small alpha gives skewed
label mixes (non-IID), large alpha approaches an IID split. A draw in which some client gets
fewer than `min_size` examples is redrawn (from the same seeded stream), because a client with
a handful of examples gets Laplace noise of scale proportional to 1/d_i and an empty client has
no data to release about.
"""

from __future__ import annotations

import numpy as np
import torch


def dirichlet_partition(
    labels: torch.Tensor,
    n_clients: int,
    alpha: float,
    seed: int,
    min_size: int = 1,
    max_tries: int = 1000,
) -> list[torch.Tensor]:
    """Sorted example indices of each client; their disjoint union is range(len(labels))."""
    if n_clients < 1:
        raise ValueError(f"n_clients must be >= 1, got {n_clients}")
    if alpha <= 0:
        raise ValueError(f"alpha must be > 0, got {alpha}")
    n = int(labels.numel())
    if n_clients * min_size > n:
        raise ValueError(f"{n} examples cannot give {n_clients} clients {min_size} each")
    y = labels.cpu().numpy()
    classes = np.unique(y)
    rng = np.random.default_rng(seed)  # explicit seed: the split depends on nothing else
    for _ in range(max_tries):
        chunks: list[list[np.ndarray]] = [[] for _ in range(n_clients)]
        for c in classes:
            idx = rng.permutation(np.flatnonzero(y == c))
            props = rng.dirichlet(np.full(n_clients, alpha))
            cuts = np.floor(np.cumsum(props)[:-1] * len(idx)).astype(int)
            for i, part in enumerate(np.split(idx, cuts)):
                chunks[i].append(part)
        parts = [np.sort(np.concatenate(ch)) for ch in chunks]
        if min(len(p) for p in parts) >= min_size:
            return [torch.from_numpy(p).long() for p in parts]
    raise ValueError(
        f"no Dirichlet(alpha={alpha}) split of {n} examples gave every one of {n_clients} clients "
        f"at least {min_size} examples in {max_tries} draws; lower min_client_size or raise alpha"
    )
