"""bench/gpu/gpu_external_timing.py runs (tiny shapes on the CPU): a row per mode and precision with
a positive time per step and its projection, in the JSON it writes."""

import json

import pytest
from bench_scripts import import_bench


@pytest.mark.slow  # in-process, too long for `make check`
def test_quick_run_times_every_setting(tmp_path):
    bench = import_bench("gpu_external_timing")
    out = bench.main(
        [
            "--quick",
            "--steps",
            "2",
            "--modes",
            "bk,functorch",
            "--precisions",
            "fp32,bf16",
            "--out",
            str(tmp_path / "t.json"),
        ]  # fmt: skip
    )
    rows = out["rows"]
    assert [(r["mode"], r["precision"]) for r in rows] == [
        ("bk", "fp32"), ("bk", "bf16"), ("functorch", "fp32"), ("functorch", "bf16")
    ]  # fmt: skip
    for r in rows:
        assert r["s_per_step"] > 0 and r["steps_timed"] == 2
        assert r["projected_hours"] == r["s_per_step"] * bench.STEPS_PER_JOB * r["jobs"] / 3600
    assert json.loads((tmp_path / "t.json").read_text())["rows"] == rows
