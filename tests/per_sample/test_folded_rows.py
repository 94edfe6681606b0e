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
                       rf"\({batch * T}, {D}\).* batch of {batch}"):  # fmt: skip
        _step(wrapped, batch)


def test_with_the_check_on_it_is_refused_before_the_first_step():
    torch.manual_seed(0)
    with pytest.raises(
        RuntimeError, match=r"module 'fc' \(Linear\) is fed .* not one row per example"
    ):
        wrap_for_dp(TokenMixer(folded=True), "bk", sample=((T, D), torch.float32))


def test_the_same_layer_batch_first_trains():
    torch.manual_seed(0)
    wrapped = wrap_for_dp(TokenMixer(folded=False), "bk", sample=((T, D), torch.float32))
    assert wrapped.per_sample_check["passed"]
    _step(wrapped, 5)  # no refusal: rows are examples (tokens stay in the second dimension)


def test_a_refusal_never_suggests_switching_the_check_off(monkeypatch):
    from dpadapter.per_sample import PerSampleCheckError, rules

    right = rules.group_norm_folded  # the per-example kernel, fused or not (`norm_fusion`)

    def wrong(module, a, *rest):
        dx, gw, gb = right(module, a, *rest)
        return dx, gw * 1.5, gb  # GroupNorm's weight gradient 50 % too large

    monkeypatch.setattr(rules, "group_norm_folded", wrong)

    class GN(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.GroupNorm(2, 4)
            self.head = nn.Linear(4, 3)

        def forward(self, x):
            return self.head(self.norm(x).mean((2, 3)))

    with pytest.raises(PerSampleCheckError) as e:
        wrap_for_dp(GN(), "bk", sample=((4, 3, 3), torch.float32))
    assert "per_sample_check" not in str(e.value) and "another finetune.grad_sample_mode" in str(
        e.value
    )


@pytest.mark.parametrize("check", [False, True])
def test_a_timm_swin_is_refused_at_its_window_attention(check):
    """Swin partitions each image into windows before attention: its qkv sees B * windows rows.
    (DaViT and MaxViT are refused the same way, at their attention's qkv; ViT and ConvNeXt
    train: tried by hand, docs/privacy.md.)"""
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model(
        "swin_tiny_patch4_window7_224", pretrained=False, num_classes=3, img_size=56,
        embed_dim=24, depths=(1, 1), num_heads=(1, 1), window_size=7,
    )  # fmt: skip
    with pytest.raises(RuntimeError, match=r"'layers\.0\.blocks\.0\.attn\.qkv' \(Linear\) is fed"):
        wrapped = wrap_for_dp(model, "bk", sample=((3, 56, 56), torch.float32), check=check)
        x, y = torch.randn(2, 3, 56, 56), torch.tensor([0, 1])
        nn.functional.cross_entropy(wrapped(x), y).backward()


# ew's expanded weights refuse such a layer themselves, at its forward (torch checks the batch)
REFUSAL = {
    "hooks": r"\[64\] rows .* batch of 4",
    "functorch": r"\[64\] rows .* batch of 4",
    "ew": r"ExpandedWeights to have batch size matching input",
}


@pytest.mark.parametrize("mode", sorted(REFUSAL))
def test_opacus_modes_refuse_folded_rows_with_the_check_off(mode):
    from opacus.optimizers import DPOptimizer

    from dpadapter.per_sample import dp_optimizer

    for folded in (True, False):
        torch.manual_seed(0)
        model = TokenMixer(folded=folded)
        # only the folded layer trains: its rows agree with each other, not with the batch
        model.head.requires_grad_(False)
        wrapped = wrap_for_dp(model, mode, sample=((T, D), torch.float32), check=False)
        opt = dp_optimizer(
            DPOptimizer, wrapped, torch.optim.SGD([model.fc.weight, model.fc.bias], lr=0.1),
            noise_multiplier=0.0, max_grad_norm=1.0, expected_batch_size=4,
        )  # fmt: skip
        if folded:
            with pytest.raises(RuntimeError, match=REFUSAL[mode]):
                _step(wrapped, 4)
                opt.step()
        else:
            _step(wrapped, 4)
            opt.step()  # batch-first: one row per example, no refusal
