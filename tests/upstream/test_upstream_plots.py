"""Each figure function writes one non-empty PNG and nothing else, from CSV-style string rows."""

from __future__ import annotations

import csv
import io

import pytest

from dpadapter.ground import plots

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

FINETUNE_CSV = """upstream,task,algorithm,epsilon,mean_accuracy,std_accuracy,n_seeds
scratch,fmnist-same,dpsgd,1,0.6144,0.0229,3
scratch,fmnist-same,dpsgd,4,0.6548,0.0330,3
standard,fmnist-same,dpsgd,1,0.8560,0.0050,3
standard,fmnist-same,dpsgd,4,0.8690,0.0070,3
dpadapter,fmnist-same,dpsgd,1,0.8600,,1
dpadapter,fmnist-same,dpsgd,4,0.8710,0.0040,3
standard,fmnist-shift,dpsgd,1,0.7420,0.0510,3
standard,fmnist-shift,dpsgd,4,0.7350,0.0480,3
"""

PRETRAIN_CSV = """upstream,gamma,public_test_accuracy,public_test_robust_accuracy
standard,,0.906,0.833
sam,0.5,0.90,0.85
sam,1.0,0.89,0.86
dpadapter,0.5,0.88,0.87
dpadapter,2.0,0.74,0.72
"""

SWEEP_CSV = """gamma,task,public_test_accuracy,public_test_robust_accuracy,mean_accuracy,\
std_accuracy
0.5,fmnist-same,0.88,0.87,0.86,0.01
0.5,fmnist-shift,0.88,0.87,0.74,0.02
2.0,fmnist-same,0.74,0.72,0.85,0.01
2.0,fmnist-shift,0.74,0.72,0.73,0.03
1.0,fmnist-same,0.85,0.84,,
"""


def _rows(text: str) -> list[dict]:
    return list(csv.DictReader(io.StringIO(text)))


@pytest.mark.parametrize(
    ("fn", "text", "kw"),
    [
        (
            plots.accuracy_vs_epsilon,
            FINETUNE_CSV,
            {"algorithm": "dpsgd", "upstream_order": ["scratch", "standard"]},
        ),
        (plots.robustness_vs_accuracy, PRETRAIN_CSV, {"noise_std": 0.05}),
        (plots.gamma_sweep, SWEEP_CSV, {}),
    ],
)
def test_writes_one_png(tmp_path, fn, text, kw):
    out = tmp_path / "figs" / "fig.png"
    path = fn(_rows(text), out, **kw)
    assert path == out
    data = out.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 5000
    assert [p.name for p in tmp_path.rglob("*") if p.is_file()] == ["fig.png"]


def test_empty_input_is_an_error(tmp_path):
    with pytest.raises(ValueError):
        plots.accuracy_vs_epsilon([], tmp_path / "a.png")
    with pytest.raises(ValueError):
        plots.gamma_sweep(_rows(PRETRAIN_CSV)[:1], tmp_path / "c.png")
    assert not list(tmp_path.iterdir())
