"""The benchmark scripts in bench/cpu and bench/gpu are not packages: tests import them by file
name."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"
# the GPU session's checks and the CPU benchmarks, one folder each
FOLDERS = (BENCH / "cpu", BENCH / "gpu")


def import_bench(name: str):
    (folder,) = [f for f in FOLDERS if (f / f"{name}.py").is_file()]
    sys.path.insert(0, str(folder))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(folder))
