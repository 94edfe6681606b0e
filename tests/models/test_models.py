import pytest
import torch
from opacus.validators import ModuleValidator

from dpadapter.models import create_model, get_head_params, replace_head
from dpadapter.models.batchnorm import freeze_batchnorm
from dpadapter.settings import ModelConfig


@pytest.mark.parametrize(
    "name,batchnorm",
    [
        ("resnet20-gn", "freeze"),
        ("cnn-gn", "freeze"),
        ("timm:resnet18", "groupnorm"),
        ("timm:resnet18", "freeze"),
    ],
)
def test_models_pass_opacus_validation_and_swap_heads(name, batchnorm):
    model = create_model(ModelConfig(name, 8, 16, batchnorm), num_classes=5, in_chans=1, seed=0)
    if batchnorm == "freeze":  # what dp_fit does before its own validation
        freeze_batchnorm(model)
    assert ModuleValidator.validate(model, strict=False) == []
    x = torch.randn(3, 1, 32, 32)
    assert model(x).shape == (3, 5)
    body = {k: v.detach().clone() for k, v in model.named_parameters()}
    replace_head(model, 7, seed=1)
    assert model(x).shape == (3, 7)
    head_ids = {id(p) for p in get_head_params(model)}
    for k, v in model.named_parameters():
        if id(v) not in head_ids:
            assert torch.equal(v, body[k]), f"{k} changed by head swap"


def test_resnet20_has_twenty_weight_layers():
    m = create_model(ModelConfig("resnet20-gn", 16, 16), 10, 3, seed=0)
    convs = [
        mod for mod in m.modules() if isinstance(mod, torch.nn.Conv2d) and mod.kernel_size == (3, 3)
    ]
    linears = [mod for mod in m.modules() if isinstance(mod, torch.nn.Linear)]
    assert len(convs) + len(linears) == 20


def test_creation_is_seeded():
    a = create_model(ModelConfig("cnn-gn", 8, 16), 5, 1, seed=3)
    b = create_model(ModelConfig("cnn-gn", 8, 16), 5, 1, seed=3)
    c = create_model(ModelConfig("cnn-gn", 8, 16), 5, 1, seed=4)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)


@pytest.mark.parametrize(
    "name, groups, expected",
    [("gnresnet10", 16, 4.90e6), ("dpnas-mnist", 8, 0.21e6)],
)
def test_dpsat_table2_models_have_the_papers_parameter_counts(name, groups, expected):
    """DP-SAT Table 2: GNResNet-10 4.90M, DPNAS-MNIST 0.21M (10 classes, 28x28 grey images)."""
    from opacus.grad_sample.utils import wrap_model

    model = create_model(ModelConfig(name, groups, 64 if name == "gnresnet10" else 16), 10, 1, 0)
    n = sum(p.numel() for p in model.parameters())
    assert round(n / 1e6, 2) == round(expected / 1e6, 2), n
    assert ModuleValidator.validate(model, strict=False) == []
    gsm = wrap_model(model, grad_sample_mode="hooks", batch_first=True, loss_reduction="mean")
    torch.nn.functional.cross_entropy(
        gsm(torch.randn(2, 1, 28, 28)), torch.tensor([1, 2])
    ).backward()
    assert all(p.grad_sample.shape[0] == 2 for p in model.parameters())
    replace_head(model, 5, seed=1)
    assert model(torch.randn(2, 1, 28, 28)).shape == (2, 5)
