"""One bk-wrapped model through Poisson-like batch sizes: large, small, large, one, none, middle.

bk keeps its buffers (`buffers.Workspace`: padded inputs, im2col and ghost patches, the arena's
kept gradients) and the fused GroupNorm's repeated weights (`norm_fusion.RepeatedWeights`) laid
out for the largest batch seen, and a smaller batch takes their first rows; the self-test runs
first, at its own sizes, on the same wrapped module. Each batch's clipped sum must be the float64
torch.func reference's on the weights of that moment (an update between batches, as training
makes, in place), to float64 rounding: a stale row, a border left unzeroed, a view of the last
batch's arena or a repeated weight gathered before the update would be off by O(1).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from noiseless import dp_sgd  # tests/ is on sys.path
from test_bookkeeping_any_module import _clipped, reference  # float64 torch.func
from torch import nn

from dpadapter.per_sample import conv as conv_mod
from dpadapter.per_sample import wrap_for_dp

SIZES = (64, 17, 64, 1, 0, 40)
SHAPE = (2, 9, 9)
CLASSES = 3
LR = 0.05


class Zoo(nn.Module):
    """Padded convolutions by im2col (few input channels) and by ghost norm or the grouped kernel,
    fused GroupNorms, a Linear over positions and a head: every kind of kept buffer."""

    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(2, 4, 3, padding=1)
        self.gn = nn.GroupNorm(2, 4)
        self.b = nn.Conv2d(4, 8, 3, stride=2, padding=1)
        self.c = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.gn2 = nn.GroupNorm(4, 8)
        self.seq = nn.Linear(8, 6)
        self.head = nn.Linear(6, CLASSES)

    def forward(self, x):
        h = torch.tanh(self.gn(self.a(x)))
        h = torch.tanh(self.gn2(self.c(torch.tanh(self.b(h)))))
        h = torch.tanh(self.seq(h.flatten(2).transpose(1, 2)))  # (n, T, 8) -> (n, T, 6)
        return self.head(h.mean(1))


@pytest.mark.parametrize("paths", ["cpu-choices", "chunked-im2col"])
def test_one_workspace_through_every_batch_size_matches_the_reference(paths, monkeypatch):
    """Paths "chunked-im2col": the choices where kernel launches dominate (a GPU's), whose im2col
    patches come in chunks of examples (`conv.PATCH_ELEMENTS` lowered to 3 examples of the
    first convolution's patches, 4 of the second's, 2 of the third's).

    Found by it: a GroupNorm whose output gradient is strided (transposed downstream) got wrong
    per-example gradients, and in the fused backward a wrong input gradient, at batch size 1:
    one example's reshape is a strided view where more examples' is a copy, and
    `native_group_norm_backward` reads its operands as contiguous (79 % off; fixed in
    `rules.group_norm_folded`)."""
    torch.manual_seed(0)
    model = Zoo().double()
    plain = copy.deepcopy(model)  # the reference's: no bk hooks, the same weights every batch
    wrapped = wrap_for_dp(model, "bk", sample=(SHAPE, torch.float64), check_batch=8)
    assert wrapped.per_sample_check["passed"] is True
    if paths == "chunked-im2col":
        wrapped.launch_bound = True
        monkeypatch.setattr(conv_mod, "PATCH_ELEMENTS", 3 * 2 * 9 * 81)
        chunks = []
        real = conv_mod.columns
        monkeypatch.setattr(conv_mod, "columns", lambda m, a: chunks.append(len(a)) or real(m, a))
    workspace = wrapped.workspace
    gen = torch.Generator().manual_seed(5)
    opt = dp_sgd(wrapped, 1.0, 32)
    size = sum(p.numel() for p in model.parameters())
    c = None
    for n in SIZES:
        x = torch.randn(n, *SHAPE, generator=gen, dtype=torch.float64)
        y = torch.randint(0, CLASSES, (n,), generator=gen)
        if c is None:  # the median norm of the first batch: about half are clipped
            c = float(reference(plain, x, y).norm(dim=1).median())
            opt.max_grad_norm = c
        plain.load_state_dict(model.state_dict())
        want = _clipped(reference(plain, x, y), c) if n else torch.zeros(size, dtype=torch.float64)
        opt.zero_grad(set_to_none=True)
        if n == 0:  # what an algorithm does for an empty Poisson batch (`empty_step`)
            for p in opt.params:
                p.grad_sample = torch.zeros((0, *p.shape), dtype=p.dtype)
        else:
            F.cross_entropy(wrapped(x), y).backward()
        opt.clip_and_accumulate()
        got = torch.cat([p.summed_grad.reshape(-1) for p in opt.params])
        err = float((got - want).norm() / want.norm()) if n else float(got.abs().max())
        assert err < 1e-10, (n, err)
        with torch.no_grad():  # an update in place, as a step makes (new weights, new version)
            for p in opt.params:
                p.sub_(LR * p.summed_grad)
    assert wrapped.workspace is workspace and workspace  # one workspace, kept throughout
    assert all(b.shape[0] == max(SIZES) for b in workspace.values())
    if paths == "chunked-im2col":
        assert 1 < max(chunks) <= 4  # every batch of more than 4 rows went in chunks
    else:
        plan = set(wrapped.last_plan.values())
        assert {"per-example-im2col", "per-example"} <= plan, plan  # im2col and grouped
