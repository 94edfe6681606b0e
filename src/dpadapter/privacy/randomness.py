"""Where a DP mechanism's randomness comes from: the job's seed, or the OS's cryptographic source.

`seeded` (the default, `privacy.randomness`): every noise draw and every Poisson mask is a
fixed function of the job's seed through torch's generators (a Mersenne Twister on the CPU,
Philox on CUDA). A run is reproducible bit for bit, which research needs; but whoever knows
the seed, which metrics.json records, can recompute the noise and subtract it, so no DP
guarantee holds against such a reader.

`secret`: each draw of the mechanism reads fresh bytes from the OS's cryptographically secure
generator (`os.urandom`, i.e. getrandom(2) on Linux) and turns them into the distribution the
accountant assumes: Gaussian noise (Box-Muller on 53-bit uniforms, in float64, then cast to
the gradient's dtype), Laplace noise (the difference of two exponentials) and Poisson masks
(each example kept when its uniform is below q). No seed, key or state exists to record or
restore: a resumed run draws fresh bytes, as an uninterrupted one would. What this is not:
the OS's bytes are the only source, but turning them into floats rounds (the same
floating-point caveat as every DP library, docs/privacy.md), and the draws run on the CPU, so
on a GPU the noise is copied over (slower for large models: 8 bytes of OS randomness per
noise coordinate). Opacus' own secure mode needs torchcsprng, which is not installable here.

The generators the run passes around stay torch generators, because code that is no mechanism
draws from them too (Opacus' DataLoader seed draw, GEP's choice of public anchors); a
generator made by `secret_generator` is seeded from the OS (never recorded), and every
mechanism draw made with it comes from `os.urandom` instead (`gaussian_noise`,
`laplace_noise`, `poisson_mask`, `standard_normal`). Opacus draws its optimizers' noise through
`opacus.optimizers.optimizer._generate_noise`; `install` routes that name (and the copy its
AdaClip optimizer imported) through `gaussian_noise`, which hands every seeded generator to
Opacus' function unchanged. Hand-written: torch has no cryptographic generator.
"""

from __future__ import annotations

import math
import os
import weakref

import numpy as np
import torch

SECRET = "secret"  # `privacy.randomness` (config.RANDOMNESS: the modes and their records)

# generators whose mechanism draws come from the OS (weak: a finished run's generators go)
_SECRET: weakref.WeakSet[torch.Generator] = weakref.WeakSet()
_OPACUS_NOISE = None  # Opacus' own `_generate_noise`, once `install` has replaced its name


def secret_generator(device: torch.device | str = "cpu") -> torch.Generator:
    """A generator seeded from the OS, whose mechanism draws come from the OS directly."""
    install()
    g = torch.Generator(device=device)
    g.manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)
    _SECRET.add(g)
    return g


def is_secret(generator: torch.Generator | None) -> bool:
    return generator is not None and generator in _SECRET


# --- draws from the OS ---------------------------------------------------------------------------
def _bits(n: int, k: int) -> np.ndarray:
    """n integers of k <= 53 bits from `os.urandom`, as float64 (exactly)."""
    raw = np.frombuffer(os.urandom(8 * n), dtype=np.uint64) >> np.uint64(64 - k)
    return raw.astype(np.float64)


def os_uniform(n: int) -> np.ndarray:
    """n uniforms on [0, 1), each from 53 bits of `os.urandom` (for comparisons with q)."""
    return _bits(n, 53) * 2.0**-53


def os_uniform_open(n: int) -> np.ndarray:
    """n uniforms on (0, 1): the midpoints of 2^52 cells, exact in float64, so that neither 0
    nor 1 occurs and every logarithm taken of them is finite and non-zero."""
    return (_bits(n, 52) + 0.5) * 2.0**-52


def os_normal(n: int) -> np.ndarray:
    """n standard normals (float64) by Box-Muller: both of each pair are used."""
    m = (n + 1) // 2
    r = np.sqrt(-2.0 * np.log(os_uniform_open(m)))
    t = 2.0 * math.pi * os_uniform(m)
    return np.concatenate([r * np.cos(t), r * np.sin(t)])[:n]


def os_normal_tensor(shape, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Standard normals of `shape` on the CPU, from the OS (torch.randn's counterpart)."""
    return torch.from_numpy(os_normal(math.prod(shape))).reshape(shape).to(dtype)


def selection_random(mode: str, seed_words: list[int]):
    """The HPO selection's random draws: numpy's seeded generator, or the OS's (secret)."""
    if mode == SECRET:
        return OSSelectionRandom()
    return np.random.default_rng(seed_words)


def _tensor(values: np.ndarray, shape, like: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(values).reshape(shape).to(device=like.device, dtype=like.dtype)


# --- the mechanisms' draws: the OS's for a secret generator, else exactly the seeded ones -------
def gaussian_noise(std: float, reference: torch.Tensor, generator=None, secure_mode: bool = False):
    """N(0, std^2) shaped like `reference`: Opacus' `_generate_noise` for a seeded generator."""
    if not is_secret(generator):
        if std == 0 or secure_mode:
            return _opacus_noise()(
                std=std, reference=reference, generator=generator, secure_mode=secure_mode
            )
        # Opacus' own draw, without the buffer of zeros it allocates first and returns only for
        # std 0: one kernel fewer per parameter tensor, the same values (issue 47)
        return torch.normal(
            mean=0, std=std, size=reference.shape, device=reference.device,
            generator=generator, dtype=reference.dtype,
        )  # fmt: skip
    if std == 0:
        return torch.zeros(reference.shape, device=reference.device, dtype=reference.dtype)
    z = os_normal(reference.numel()) * std
    return _tensor(z, reference.shape, reference)


def standard_normal(
    n: int, generator: torch.Generator, dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    """n standard normals where `generator` lives (torch.randn for a seeded generator)."""
    if not is_secret(generator):
        return torch.randn(n, generator=generator, dtype=dtype, device=generator.device)
    return _tensor(os_normal(n), (n,), torch.empty(0, dtype=dtype, device=generator.device))


def laplace_noise(shape, scale: float, generator: torch.Generator | None, like: torch.Tensor):
    """Lap(0, scale) i.i.d., as the difference of two Exp(1) draws times scale (exact law)."""
    if scale == 0:
        return torch.zeros(shape, dtype=like.dtype, device=like.device)
    if is_secret(generator):
        n = math.prod(shape)
        e1, e2 = -np.log(os_uniform_open(n)), -np.log(os_uniform_open(n))
        return _tensor((e1 - e2) * scale, shape, like)
    e1 = torch.empty(shape, dtype=like.dtype, device=like.device).exponential_(
        1.0, generator=generator
    )
    e2 = torch.empty(shape, dtype=like.dtype, device=like.device).exponential_(
        1.0, generator=generator
    )
    return (e1 - e2) * scale


def poisson_mask(n: int, rate: float, generator: torch.Generator) -> torch.Tensor:
    """Each of n examples kept with probability `rate` (on the CPU); Opacus' draw when seeded."""
    if is_secret(generator):
        return torch.from_numpy(os_uniform(n) < rate)
    return torch.rand(n, generator=generator) < rate


def _opacus_noise():
    if _OPACUS_NOISE is not None:
        return _OPACUS_NOISE
    from opacus.optimizers import optimizer

    return optimizer._generate_noise


def install() -> None:
    """Opacus' optimizers draw their noise through `gaussian_noise` (seeded: unchanged)."""
    global _OPACUS_NOISE
    from opacus.optimizers import adaclipoptimizer, optimizer

    if _OPACUS_NOISE is None:
        _OPACUS_NOISE = optimizer._generate_noise
    optimizer._generate_noise = gaussian_noise
    adaclipoptimizer._generate_noise = gaussian_noise


class OSSelectionRandom:
    """The draws the HPO's private selection makes (numpy's `gumbel`, `normal`), from the OS."""

    def gumbel(self, size: int) -> np.ndarray:
        return -np.log(-np.log(os_uniform_open(size)))

    def normal(self, loc: float, scale: float, size: int) -> np.ndarray:
        return loc + scale * os_normal(size)
