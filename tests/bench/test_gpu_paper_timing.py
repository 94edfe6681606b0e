"""bench/gpu/gpu_paper_timing.py times DP steps through the pipeline's own per-sample wrapper.

It once handed the config's mode to Opacus' `wrap_model`, which knows no `bk` (the default), and
crashed before writing anything. Here: the paper config's own mode (bk), on the CPU at a tiny
scale, writing its JSON (the Opacus modes go through the same `wrap_for_dp`, tested in
tests/train).
"""

from __future__ import annotations

import json

import pytest
from bench_scripts import import_bench


@pytest.mark.slow  # in-process, too long for `make check`
@pytest.mark.parametrize("mode", ["bk"])
def test_paper_timing_runs_in_the_configs_mode(mode, tmp_path, monkeypatch):
    timing = import_bench("gpu_paper_timing")
    real_load = timing.load

    def load(path):  # the paper config, in the mode under test
        import dataclasses

        cfg = real_load(path)
        return dataclasses.replace(
            cfg, finetune=dataclasses.replace(cfg.finetune, grad_sample_mode=mode)
        )

    monkeypatch.setattr(timing, "load", load)
    out = tmp_path / "t.json"
    rc = timing.main(
        ["--quick", "--scale", "250", "--reps", "1", "--algorithms", "dpsgd", "--out", str(out)]
    )
    assert rc == 0
    got = json.loads(out.read_text())
    assert got["done"] and got["seconds"]["finetune_step_dpsgd"] > 0
    assert "not projected" in got["projection_device_hours"]
