"""bench/cpu/bk_equivalence.py on small inputs: the shipped configs' models are found, bk's clipped
sum matches ew's and torch.func's on the embedded CNN (the bench itself covers every model,
ViTs included), and a wrong clip factor is caught."""

from __future__ import annotations

import pytest
from bench_scripts import import_bench


@pytest.fixture(scope="module")
def eq():
    return import_bench("bk_equivalence")


@pytest.fixture(scope="module")
def cases(eq):
    return eq.collect()


def test_every_model_of_the_shipped_configs_is_collected(cases):
    labels = [c.label for c in cases]
    for name in ("cnn-gn", "resnet20-gn", "gnresnet10", "dpnas-mnist", "dpfl-cnn"):
        assert any(lbl.startswith(name) for lbl in labels), name
    for arch in ("vit_small_patch16_224", "vit_base_patch16_224", "deit_base", "crossvit_18"):
        assert any(arch in lbl for lbl in labels), arch
    assert any("probe" in lbl for lbl in labels) and any("audit" in lbl for lbl in labels)


@pytest.mark.parametrize("phase", ["ft", "ht", "bitfit"])
def test_bk_gives_ews_clipped_sum_on_the_embedded_cnn(eq, cases, phase):
    case = next(c for c in cases if c.label.startswith("cnn-gn"))
    row = eq.check_case(case, phase, batch=4)
    assert row["bk"]["rel"] < 1e-12 and row["ew"]["rel"] < 1e-12 and row["bk_vs_ew"]["rel"] < 1e-12
    assert eq.passed(row, 1e-9)


def test_a_wrong_clip_factor_fails_the_check(eq, cases, monkeypatch):
    from dpadapter.per_sample import optimizers

    real = optimizers.clip_factors
    monkeypatch.setattr(optimizers, "clip_factors", lambda n, c: real(n, c * 1.01))
    case = next(c for c in cases if c.label.startswith("cnn-gn"))
    row = eq.check_case(case, "ft", batch=4)
    assert row["bk"]["rel"] > 1e-4 and not eq.passed(row, 1e-9)
    assert "| NO |" in eq.table([row], 1e-9)
