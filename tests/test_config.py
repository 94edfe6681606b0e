"""Bad config is reported by key before any work starts."""

import subprocess
import sys

import pytest
import yaml

from dpadapter.config import ConfigError, from_dict
from dpadapter.validation import load, validate


def test_embedded_and_paper_configs_are_valid():
    load("config.yaml")
    load("configs/paper.yaml")


@pytest.mark.parametrize(
    "mutate,expected",
    [
        (lambda r: r.update(typo_key=1), "typo_key"),
        (lambda r: r["finetune"].update(epsilons=[-1]), "finetune.epsilons.0"),
        (lambda r: r["finetune"].update(lr_rate=0.1), "lr_rate"),
        (lambda r: r["tasks"]["syn-same"].update(n_train="many"), "tasks.syn-same.n_train"),
        (lambda r: r["finetune"].update(algorithms=["dp-magic"]), "dp-magic"),
        (lambda r: r["pretrain"].update(methods=["alchemy"]), "alchemy"),
        (lambda r: r["public"].update(dataset="imagenet-42"), "imagenet-42"),
        (lambda r: r["model"].update(name="vgg-nope"), "vgg-nope"),
        (lambda r: r["privacy"].update(delta=2), "privacy.delta"),
        (lambda r: r["finetune"].update(grad_sample_mode="ghost"), "grad_sample_mode"),
    ],
)
def test_errors_name_the_bad_key(tiny_raw, mutate, expected):
    mutate(tiny_raw)
    with pytest.raises(ConfigError, match=expected.replace(".", r"\.")):
        validate(tiny_raw)


def test_cli_reports_bad_config_and_exits_2(tmp_path, tiny_raw):
    tiny_raw["warmup"]["epochs"] = "three"
    p = tmp_path / "bad.yaml"
    p.write_text(yaml.safe_dump(tiny_raw))
    r = subprocess.run(
        [sys.executable, "-m", "dpadapter", "--config", str(p), "validate"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2
    assert "warmup.epochs" in r.stderr


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load(tmp_path / "nope.yaml")


def test_finetune_grid_is_main_product_plus_extra_grids(tiny_raw):
    tiny_raw["finetune"]["extra_grids"] = [
        {
            "upstreams": ["standard"],
            "tasks": ["syn-shift"],
            "algorithms": ["dpsgd"],
            "seeds": [0, 7],
        }
    ]
    grid = from_dict(tiny_raw).finetune_grid()
    main = {
        (u, t, "dpsgd", e, 0)
        for u in ("scratch", "standard")
        for t in ("syn-same", "syn-shift")
        for e in (1.0, 4.0)
    }
    extra = {("standard", "syn-shift", "dpsgd", e, 7) for e in (1.0, 4.0)}
    assert set(grid) == main | extra and len(grid) == len(main | extra)


def test_extra_grid_names_are_checked(tiny_raw):
    tiny_raw["finetune"]["extra_grids"] = [{"upstreams": ["sam"], "algorithms": ["dpsgd"]}]
    with pytest.raises(ConfigError, match=r"extra_grids\.0\.upstreams"):
        validate(tiny_raw)
