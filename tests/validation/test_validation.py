"""dpadapter.validation.compose: every mistake of issue 13 is refused by name before any job
starts."""

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from dpadapter.algorithms import ALGORITHMS
from dpadapter.data import DATASET_INFO, load_dataset, missing_files
from dpadapter.data.registry import DatasetUnavailable
from dpadapter.ground.param_schema import param_errors
from dpadapter.settings import ConfigError
from dpadapter.upstream import UPSTREAMS
from dpadapter.validation.compose import full_schema, validate, variant_problems

REPO = Path(__file__).resolve().parents[2]
DEFAULT = yaml.safe_load((REPO / "config.yaml").read_text())


def _rejected(raw: dict, *expected: str) -> str:
    with pytest.raises(ConfigError) as info:
        validate(raw)
    msg = str(info.value)
    for e in expected:
        assert e in msg, msg
    return msg


def _default(mutate) -> dict:
    raw = copy.deepcopy(DEFAULT)
    mutate(raw)
    return raw


# --- per-method params schemas ---------------------------------------------------------------


@pytest.mark.parametrize(
    "cls", [*UPSTREAMS.values(), *ALGORITHMS.values()], ids=[*UPSTREAMS, *ALGORITHMS]
)
def test_every_registered_class_declares_a_closed_schema_of_its_defaults(cls):
    schema = cls.params_schema
    assert schema["type"] == "object" and schema["additionalProperties"] is False
    required = set(schema.get("required", ()))  # params with no default (external's weights)
    assert sorted(schema["properties"]) == sorted({*cls.default_params(), *required})
    if not required:
        assert param_errors(schema, cls.default_params(), cls.name) == []


@pytest.mark.parametrize(
    "mutate,expected",
    [
        (
            lambda r: r["pretrain"]["params"]["dpadapter"].update(gama=0.5),
            "pretrain.params.dpadapter.gama: unknown parameter; known: [",
        ),
        (
            lambda r: r["pretrain"]["params"]["dpadapter"].update(m1="5000"),
            "pretrain.params.dpadapter.m1: '5000' is not of type 'integer'",
        ),
        (
            lambda r: r["pretrain"]["params"]["dpadapter"].update(gamma=-1),
            "pretrain.params.dpadapter.gamma: -1 is less than the minimum of 0",
        ),
        (
            lambda r: r["pretrain"]["params"]["dpadapter"].update(m1=0),
            "pretrain.params.dpadapter.m1: 0 is less than the minimum of 1",
        ),
        (
            lambda r: r["pretrain"]["params"]["sam"].update(milestones=["5"]),
            "pretrain.params.sam.milestones.0: '5' is not of type 'integer'",
        ),
        (
            lambda r: r["finetune"].update(algo_params={"dpsgd": {"rho": 0.05}}),
            "finetune.algo_params.dpsgd.rho: unknown parameter; known: []",
        ),
        (
            lambda r: r["finetune"].update(algo_params={"gep": {"public_labels": "true"}}),
            "finetune.algo_params.gep.public_labels:",
        ),
        (
            lambda r: r["finetune"].update(algo_params={"dp-magic": {}}),
            "finetune.algo_params.dp-magic: unknown key",
        ),
        (lambda r: r["pretrain"]["params"].update(alchemy={}), "pretrain.params.alchemy"),
        (
            lambda r: r["pretrain"]["params"]["control"].update(match="standard"),
            "pretrain.params.control.match: 'standard' has no SGD schedule",
        ),
    ],
)
def test_method_and_algorithm_params_are_checked_by_name(mutate, expected):
    _rejected(_default(mutate), expected)


def test_the_constructors_check_the_same_schema():
    with pytest.raises(ValueError, match=r"pretrain\.params\.dpadapter\.m1: '5000'"):
        UPSTREAMS["dpadapter"]({"m1": "5000"})


def test_sweep_variants_are_checked_against_the_method_schema():
    msg = _rejected(
        _default(lambda r: r["sweeps"].update(methods=["standard", "dpadapter"])),
        "sweeps.methods.0",
        "pretrain.params.standard.gamma: unknown parameter",
    )
    assert "sweeps.methods.1" not in msg
    assert variant_problems("dpadapter+gamma=0.5", {}, "x") == []
    assert "gama: unknown parameter" in variant_problems("dpadapter+gama=0.5", {}, "x")[0]
    # the config's params under the override are checked too (what the job would construct)
    bad = variant_problems("dpadapter+gamma=1", {"dpadapter": {"m2": "64"}}, "x")
    assert bad and "pretrain.params.dpadapter.m2: '64'" in bad[0]
    assert "m1: 0.5 is not of type 'integer'" in variant_problems("dpadapter+m1=0.5", {}, "x")[0]


def test_schema_plugs_in_every_registered_name():
    s = full_schema()["properties"]
    assert set(s["pretrain"]["properties"]["params"]["properties"]) == set(UPSTREAMS)
    assert set(s["finetune"]["properties"]["algo_params"]["properties"]) == set(ALGORITHMS)


# --- data --------------------------------------------------------------------------------------


def test_class_ids_out_of_range_are_refused():
    _rejected(
        _default(lambda r: r["tasks"]["fmnist-same"].update(classes=[0, 1, 2, 3, 14])),
        "tasks.fmnist-same.classes: [14] out of range: fashion-mnist has classes 0..9",
    )


def test_split_sizes_beyond_the_source_pool_are_refused(tiny_raw):
    # public 1000 + syn-same 700 of classes 0-4, 300 per class in the synthetic train split
    tiny_raw["tasks"]["syn-same"]["n_train"] = 600
    _rejected(tiny_raw, "tasks.syn-same.n_train: public + tasks.syn-same ask for 1700 train")
    tiny_raw["tasks"]["syn-same"]["n_train"] = 300
    tiny_raw["tasks"]["syn-shift"]["n_test"] = 501
    _rejected(tiny_raw, "tasks.syn-shift.n_test: tasks.syn-shift ask for 501 test")
    tiny_raw["tasks"]["syn-shift"]["n_test"] = 500
    validate(tiny_raw)  # the exact size of the pool fits


def test_declared_counts_match_the_synthetic_loader(tmp_path):
    train, test = load_dataset("synthetic", tmp_path)
    info = DATASET_INFO["synthetic"]
    assert tuple(torch.bincount(train.labels).tolist()) == info.train_counts
    assert tuple(torch.bincount(test.labels).tolist()) == info.test_counts


def test_missing_files_are_reported_with_the_loaders_message(tmp_path, tiny_raw):
    msg = missing_files("cifar10", tmp_path, download=False)
    with pytest.raises(DatasetUnavailable) as info:
        load_dataset("cifar10", tmp_path, download=False)
    assert msg and str(info.value).startswith(msg)  # the loader adds torchvision's reason
    assert missing_files("cifar10", tmp_path, download=True) is None
    tiny_raw["data"]["root"] = str(tmp_path)
    tiny_raw["tasks"]["syn-shift"]["dataset"] = "cifar10"
    for role in (tiny_raw["public"], tiny_raw["tasks"]["syn-same"]):
        role["channels"] = 3  # the grey roles as RGB, as cifar10's
    validate(tiny_raw)  # the file check is the workflow's (check_files=True)
    with pytest.raises(ConfigError, match=r"tasks\.syn-shift\.dataset: dataset 'cifar10'"):
        validate(tiny_raw, check_files=True)


def test_missing_fashion_mnist_is_reported(tmp_path, monkeypatch):
    from dpadapter.data import sources

    monkeypatch.setattr(sources, "DEBIAN_FASHION_MNIST", tmp_path / "no-debian")
    msg = missing_files("fashion-mnist", tmp_path, download=False)
    assert "apt-get install dataset-fashion-mnist" in msg
    raw = _default(lambda r: r["data"].update(root=str(tmp_path)))
    with pytest.raises(ConfigError, match=r"public\.dataset: dataset 'fashion-mnist'"):
        validate(raw, check_files=True)


def test_fashion_mnist_from_a_carried_folder(tmp_path, monkeypatch):
    """$FMNIST_DIR stands in for Debian's package (a GPU image without apt;
    bench/gpu/gpu_env.sh)."""
    import gzip

    from dpadapter.data import sources

    monkeypatch.setattr(sources, "DEBIAN_FASHION_MNIST", tmp_path / "no-debian")
    carried = tmp_path / "carried"
    carried.mkdir()
    monkeypatch.setenv(sources.FMNIST_ENV, str(carried))
    assert "$FMNIST_DIR" in missing_files("fashion-mnist", tmp_path / "root", download=False)
    for f in sources._FMNIST_FILES:
        with gzip.open(carried / f"{f}.gz", "wb") as out:
            out.write(f.encode())
    assert missing_files("fashion-mnist", tmp_path / "root", download=False) is None
    raw = sources.prepare_fashion_mnist(tmp_path / "root", download=False)
    assert [(raw / f).read_text() for f in sources._FMNIST_FILES] == list(sources._FMNIST_FILES)


# --- privacy -----------------------------------------------------------------------------------


def test_delta_of_one_over_n_or_more_is_refused():
    _rejected(
        _default(lambda r: r["privacy"].update(delta=0.5)),
        "privacy.delta: 0.5 is not below 1/n = 0.0005 for task 'fmnist-same'",
    )
    _rejected(_default(lambda r: r["privacy"].update(delta=1 / 2000)), "privacy.delta")
    validate(_default(lambda r: r["privacy"].update(delta=1 / 2001)))


def test_delta_written_as_1e_5_gets_a_hint():
    raw = yaml.safe_load("privacy: {delta: 1e-5}")
    assert raw["privacy"]["delta"] == "1e-5"  # PyYAML (YAML 1.1) reads a string
    _rejected(
        _default(lambda r: r["privacy"].update(delta="1e-5")),
        "privacy.delta: '1e-5' is not of type 'number'",
        "write 1.0e-5",
    )


def test_unreachable_epsilon_is_refused_at_validation():
    _rejected(
        _default(lambda r: r["finetune"].update(epsilons=[1, 1000])),
        "finetune.epsilons: epsilon 1000 on task 'fmnist-same' is out of reach",
    )
    _rejected(_default(lambda r: r["sweeps"].update(epsilon=100000)), "sweeps.epsilon")


def test_a_job_checks_the_reach_of_its_own_cell_only(tiny_raw, tmp_path, capsys):
    """The workflow refuses an unreachable grid epsilon before any job; a job validates again
    but checks the cell it trains only (each (q, steps) costs the RDP bound ~0.25 s)."""
    from dpadapter.launch.cli import main
    from dpadapter.validation.compose import validate_files

    tiny_raw["finetune"]["epsilons"] = [1, 1000]
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(tiny_raw))
    unreachable = "finetune.epsilons: epsilon 1000 on task 'syn-shift' is out of reach"
    for cells in (None, [("syn-shift", 1000)], [("syn-shift", 1000.0), ("syn-same", 1)]):
        with pytest.raises(ConfigError, match="out of reach") as info:
            validate_files(tiny_raw, [cfg], cells=cells)
        assert unreachable in str(info.value)
    for cells in ([], [("syn-shift", 1)], [("syn-same", 4)]):
        validate_files(tiny_raw, [cfg], cells=cells)
    # the CLI: `validate` checks every cell, a fine-tuning job its own, before it trains
    job = ["finetune", "--upstream", "scratch", "--algo", "dpsgd", "--seed", "0"]
    job += ["--ckpt", str(tmp_path / "none.pt"), "--out", str(tmp_path / "out")]
    for argv in (["validate"], [*job, "--task", "syn-shift", "--eps", "1000"]):
        assert main(["--config", str(cfg), *argv]) == 2
        assert unreachable in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    # a stage that trains no cell checks none (here one that reads finished runs: none yet)
    assert main(["--config", str(cfg), "table-so-far", "--out", str(tmp_path / "so-far")]) == 0
    assert "out of reach" not in capsys.readouterr().err


def test_batch_larger_than_a_task_is_refused(tiny_raw):
    tiny_raw["finetune"]["batch_size"] = 301
    _rejected(tiny_raw, "finetune.batch_size: 301 exceeds task 'syn-same'")


# --- structure ---------------------------------------------------------------------------------


@pytest.mark.process
def test_the_settings_package_imports_no_registry():
    code = (
        "import sys, dpadapter.settings\n"
        "bad = [m for m in sys.modules if m.startswith(('dpadapter.algorithms', "
        "'dpadapter.upstream', 'dpadapter.data', 'dpadapter.models', 'dpadapter.privacy', "
        "'dpadapter.validation.compose', 'dpadapter.registries.catalog'))]\n"
        "print(bad)\n"
        "sys.exit(1 if bad else 0)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.process
def test_cli_validates_with_the_registries(tmp_path, tiny_raw):
    tiny_raw["pretrain"]["params"] = {"sam": {"gama": 1.0}}
    p = tmp_path / "bad.yaml"
    p.write_text(yaml.safe_dump(tiny_raw))
    r = subprocess.run(
        [sys.executable, "-m", "dpadapter", "--config", str(p), "validate"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and "pretrain.params.sam.gama: unknown parameter" in r.stderr


def test_bk_is_the_default_mode_and_every_registered_model_validates_under_it():
    """No model is refused for bk at validation: dp_fit and the federated stage freeze every
    BatchNorm before wrapping (tests/models/test_frozen_batchnorm.py trains one under bk), and
    bk refuses a BatchNorm in training mode by name at wrap time."""
    from dpadapter.models import MODEL_NAMES

    raw = copy.deepcopy(DEFAULT)
    raw["finetune"].pop("grad_sample_mode", None)
    assert validate(raw).finetune.grad_sample_mode == "bk"
    for name in sorted(MODEL_NAMES):
        raw["model"]["name"] = name
        assert validate(raw).model.name == name
