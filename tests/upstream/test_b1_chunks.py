"""DPAdapter's B1 gradient: chunks from a host-resident public set, and halving on out-of-memory.

Neither can happen on the CPU by itself (pinning needs CUDA; the CPU does not run out of memory
at these sizes), so both are forced here: the pinned path by declaring the data pinned, the
out-of-memory error by a forward that raises above a chunk size (issue 23, items 5 and 6).
"""

from __future__ import annotations

import weakref

import pytest
import torch
from upstream.upstream_helpers import indexed_data, small_model

import dpadapter.ground.device as devices
from dpadapter.upstream import UPSTREAMS
from dpadapter.upstream import perturbed as perturbed_mod

M1 = 40


def _step(chunk_size: int = 16):
    method = UPSTREAMS["dpadapter"]({"m1": M1, "m2": 8, "gamma": 0.5, "chunk_size": chunk_size})
    return method.make_step(indexed_data(96), 0)


def _b1_gradient(step, model):
    index = step.sampler.draw()
    return step._gradient(model, step.x_all, step.y_all, index), index


def _reference(model, step, index):
    """The B1 gradient in one chunk, nothing forced."""
    return perturbed_mod.batch_gradient(model, step.x_all, step.y_all, len(index), index=index)


def _close(a, b):
    return all(torch.allclose(x, y, atol=1e-7, rtol=1e-5) for x, y in zip(a, b, strict=True))


def test_chunks_of_a_pinned_public_set_are_staged_and_moved_to_the_parameters(monkeypatch):
    """The large-set path (public set in pinned host memory): every chunk is gathered into a
    pinned buffer and sent to the parameters' device; the gradient is the small-set path's."""
    model = small_model(seed=1)
    small = _step()
    (small_grads, small_loss), index = _b1_gradient(small, model)

    staged: list[torch.Tensor] = []
    sent: list[torch.device] = []
    real_to = torch.Tensor.to

    def pinned_empty(shape, dtype):
        staged.append(torch.empty(shape, dtype=dtype))
        return staged[-1]

    def spy_to(self, *args, **kwargs):
        if any(self is s for s in staged):
            sent.append(args[0] if args else kwargs["device"])
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(devices, "_is_pinned", lambda t: True)
    monkeypatch.setattr(devices, "_pinned_empty", pinned_empty)
    monkeypatch.setattr(torch.Tensor, "to", spy_to)
    large = _step()
    (large_grads, large_loss), large_index = _b1_gradient(large, model)
    monkeypatch.undo()

    assert torch.equal(index, large_index)  # the same B1 draw
    chunks = -(-M1 // 16)
    assert len(staged) == 2 * chunks, "every chunk's x and y are staged in a pinned buffer"
    assert sent == [next(model.parameters()).device] * (2 * chunks)
    assert _close(small_grads, large_grads) and large_loss == pytest.approx(small_loss)
    ref, _ = _reference(model, small, index)
    assert _close(ref, large_grads)


def _fail_above(model, limit: int, error, seen: list[int], alive: list | None = None):
    real = model.forward

    def forward(x):
        seen.append(len(x))
        if len(x) > limit:
            if alive is not None:
                alive.append(weakref.ref(x))
            raise error()  # a fresh exception, as a real allocator raises
        return real(x)

    model.forward = forward


OOM_ERRORS = {
    "cuda": lambda: torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
    "other-backend": lambda: RuntimeError("MPS backend out of memory (MPS allocated: 1 GB)"),
}


@pytest.mark.parametrize("kind", sorted(OOM_ERRORS))
def test_out_of_memory_halves_the_chunk_until_it_fits(kind, monkeypatch):
    model = small_model(seed=1)
    step = _step(chunk_size=32)
    index = step.sampler.draw()
    ref, ref_loss = _reference(model, step, index)
    seen: list[int] = []
    alive: list = []
    at_release: list[list[bool]] = []

    def release(device):
        # by now nothing may hold the failed chunk (the exception's frames included)
        at_release.append([r() is not None for r in alive])

    monkeypatch.setattr(perturbed_mod, "release_cached_memory", release)
    _fail_above(model, 10, OOM_ERRORS[kind], seen, alive)
    grads, loss = step._gradient(model, step.x_all, step.y_all, index)
    assert step.chunk_size == 8  # 32 -> 16 -> 8, the first size that fits
    assert seen[:2] == [32, 16] and set(seen[2:]) == {8}
    assert at_release == [[False], [False, False]], "memory released while the chunk was alive"
    assert _close(ref, grads) and loss == pytest.approx(ref_loss)
    # the size used is recorded: in the epoch's statistics and in the resume state
    step.stats.b1_batches = 1
    assert step.pop_epoch_stats()["b1_chunk_size"] == 8
    assert step.state_dict()["chunk_size"] == 8
    fresh = _step(chunk_size=32)
    fresh.load_state_dict(step.state_dict())
    assert fresh.chunk_size == 8


def test_other_errors_are_not_taken_for_out_of_memory():
    model = small_model(seed=1)
    step = _step(chunk_size=32)
    _fail_above(model, 10, lambda: RuntimeError("mat1 and mat2 shapes cannot be multiplied"), [])
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        _b1_gradient(step, model)
    assert step.chunk_size == 32


def test_a_clear_error_when_one_example_does_not_fit(monkeypatch):
    monkeypatch.setattr(perturbed_mod, "release_cached_memory", lambda device: None)
    model = small_model(seed=1)
    step = _step(chunk_size=4)
    seen: list[int] = []
    _fail_above(model, 0, lambda: torch.OutOfMemoryError("CUDA out of memory"), seen)
    with pytest.raises(RuntimeError, match="out of memory with one example per chunk"):
        _b1_gradient(step, model)
    assert seen == [4, 2, 1]
