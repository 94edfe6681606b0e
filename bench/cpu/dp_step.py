"""`make bench`: DP step / non-private step for every per-sample mode, each beside its check.

The modes are the pipeline's (`bk`, the default `finetune.grad_sample_mode`, and Opacus'
`hooks`, `functorch`, `ew`) and Opacus' fast gradient clipping (`ghost`, `fgc`), on ResNet20-GN
(3x32x32, batch 256) and the embedded default's CNN (1x28x28, batch 200). Each ratio is printed
with that mode's clipped-sum check: its `p.summed_grad` (noise 0, float64) against a per-example
loop, relative error in brackets; a wrong sum fails the run. `bench/cpu/dp_modes.py` does the work
(it takes the same arguments, e.g. `--steps 20 --threads 2`).

    .venv/bin/python bench/cpu/dp_step.py [dp_modes.py arguments]
"""

from __future__ import annotations

import statistics
import sys
import time

MODELS = ["--models", "resnet20-gn", "cnn-gn"]


def _median_step(step, warmup: int, steps: int) -> float:
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    import dp_modes  # bench/ is on sys.path when run as a script

    argv = sys.argv[1:] if argv is None else argv
    return dp_modes.main(argv if "--models" in argv else [*MODELS, *argv])


if __name__ == "__main__":
    sys.exit(main())
