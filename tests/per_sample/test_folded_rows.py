"""bk's closed forms take a layer's rows as its examples: a layer fed the batch folded with
something else (`x.reshape(B * k, d)`) is refused by name on every recorded call, with the
self-test on or off (issue 45: before, a shape error deep in the clip stopped it by accident)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dpadapter.per_sample import wrap_for_dp

T, D = 16, 8


class TokenMixer(nn.Module):
    """A token mixer written over flattened rows: `fc` sees B * T rows, not B examples."""

    def __init__(self, folded: bool):
        super().__init__()
        self.folded = folded
        self.fc = nn.Linear(D, D)
        self.head = nn.Linear(D, 3)

    def forward(self, x):
        b = x.shape[0]
        h = self.fc(x.reshape(b * T, D)).reshape(b, T, D) if self.folded else self.fc(x)
        return self.head(torch.relu(h).mean(1))


def _step(wrapped, batch: int):
    x, y = torch.randn(batch, T, D), torch.randint(0, 3, (batch,))
    nn.functional.cross_entropy(wrapped(x), y).backward()


@pytest.mark.parametrize("batch", [4, 1])
def test_a_layer_fed_folded_rows_is_refused_by_name_with_the_check_off(batch):
    torch.manual_seed(0)
    wrapped = wrap_for_dp(
        TokenMixer(folded=True), "bk", sample=((T, D), torch.float32), check=False
    )
    with pytest.raises(RuntimeError, match=rf"module 'fc' \(Linear\) is fed an input of shape "
                       rf"\({batch * T}, {D}\) .* batch of {batch}"):  # fmt: skip
        _step(wrapped, batch)


def test_with_the_check_on_it_is_refused_before_the_first_step():
    torch.manual_seed(0)
    with pytest.raises(RuntimeError, match=r"module 'fc' \(Linear\) is fed .* not the batch"):
        wrap_for_dp(TokenMixer(folded=True), "bk", sample=((T, D), torch.float32))


def test_the_same_layer_batch_first_trains():
    torch.manual_seed(0)
    wrapped = wrap_for_dp(TokenMixer(folded=False), "bk", sample=((T, D), torch.float32))
    assert wrapped.per_sample_check["passed"]
    _step(wrapped, 5)  # no refusal: rows are examples (tokens stay in the second dimension)
