"""Training jobs write progress lines to their log (stderr), as a Slurm user reads it."""

from __future__ import annotations

import io
import re

import pytest

from dpadapter.stages import finetune, pretrain, warmup
from dpadapter.train.progress import ProgressLine

TIME = r"elapsed \d+:\d\d:\d\d eta (\d+:\d\d:\d\d|\?)"


def test_line_fields_and_remaining_time():
    out = io.StringIO()
    line = ProgressLine("job", total_steps=100, start_step=20, every_s=1e9, stream=out)
    assert "resumed at step 20/100" in out.getvalue()
    line.t0 -= 8.0  # 8 s for the 20 steps taken since the start: 24 s for the remaining 60
    line.epoch(
        2,
        5,
        {"steps": 40, "train_loss": 0.5, "val_accuracy": 0.75, "epsilon_spent": 1.5,
         "noise_multiplier": 1.1, "other": 3},
    )  # fmt: skip
    last = out.getvalue().splitlines()[-1]
    assert re.search(
        r"\[job\] epoch 2/5 step 40/100 loss 0.5000 val_acc 0.7500 eps 1.500 sigma 1.1000 "
        r"elapsed 0:00:08 eta 0:00:24$",
        last,
    ), last
    line.step(41, 0.4)  # within every_s of the last line: nothing printed
    assert len(out.getvalue().splitlines()) == 2
    line.every_s = 0.0
    line.step(42, 0.4)
    assert re.search(r"step 42/100 loss 0.4000 " + TIME, out.getvalue().splitlines()[-1])


def test_warmup_and_dpadapter_logs_have_a_line_per_epoch(tiny_raw, tmp_path, monkeypatch, capfd):
    from dpadapter.settings import from_dict

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlruns.db'}")
    tiny_raw["public"].update(n_train=300, n_val=100)
    tiny_raw["warmup"]["epochs"] = 2
    tiny_raw["pretrain"]["params"] = {
        "dpadapter": {"epochs": 2, "m1": 64, "m2": 64, "gamma": 0.5, "lr": 0.01, "milestones": []}
    }
    cfg = from_dict(tiny_raw)
    warmup.run(cfg, tmp_path / "warmup")
    pretrain.run(cfg, "dpadapter", tmp_path / "dpadapter", tmp_path / "warmup" / "model.pt")
    err = capfd.readouterr().err
    for label in ("warmup", "dpadapter"):
        lines = [s for s in err.splitlines() if f"[{label}] epoch" in s]
        assert len(lines) == 2, err
        for e, s in enumerate(lines, 1):
            assert re.search(
                rf"epoch {e}/2 step {5 * e}/10 loss \d\.\d{{4}} val_acc \d\.\d{{4}} .*{TIME}$", s
            ), s


@pytest.mark.slow  # in-process, too long for `make check`
def test_finetune_job_log_has_dp_fields_per_epoch(tiny_raw, tmp_path, monkeypatch, capfd):
    from dpadapter.settings import from_dict

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlruns.db'}")
    tiny_raw["privacy"]["accountant"] = "rdp"  # calibrates in a fraction of PRV's time
    cfg = from_dict(tiny_raw)
    pretrain.run(cfg, "scratch", tmp_path / "pre", None)
    capfd.readouterr()
    finetune.run(cfg, "scratch", "syn-same", "dpsgd", 2.0, 0, tmp_path / "pre" / "model.pt",
                 tmp_path / "ft")  # fmt: skip
    err = capfd.readouterr().err
    label = "[finetune scratch/syn-same/dpsgd/eps2/seed0] epoch"
    lines = [s for s in err.splitlines() if label in s]
    assert len(lines) == 2, err  # tiny config: 2 epochs of 300 / 50 = 6 steps
    for e, s in enumerate(lines, 1):
        assert re.search(
            rf"epoch {e}/2 step {6 * e}/12 loss \d+\.\d{{4}} val_acc \d\.\d{{4}} "
            rf"eps \d+\.\d{{3}} sigma \d+\.\d{{4}} {TIME}$",
            s,
        ), s
