"""Put `dpadapter-torchvision-compat.pth` into the venv's site-packages (the Makefile's set-up).

Without it a plain `import timm` (or torchvision) in the project's venv fails with "operator
torchvision::nms does not exist" unless `dpadapter` was imported first (docs/torchvision-cpu.md).
A `.pth` file's `import` line runs at every interpreter start: it imports `dpadapter` (about
0.06 s: only the compatibility hook, no torch), so a notebook, a one-liner or another tool gets
a working torchvision too. Rewritten on every set-up; `python tools/install_compat_pth.py
--remove` takes it out.
"""

from __future__ import annotations

import sys
import sysconfig
from pathlib import Path

NAME = "dpadapter-torchvision-compat.pth"
# `import dpadapter` fails harmlessly (no output, nothing imported) where the package is absent
LINE = "import importlib.util as _u; _u.find_spec('dpadapter') and __import__('dpadapter')\n"


def main() -> int:
    target = Path(sysconfig.get_paths()["purelib"]) / NAME
    if "--remove" in sys.argv:
        target.unlink(missing_ok=True)
    else:
        target.write_text(LINE)
    print(("removed " if "--remove" in sys.argv else "wrote ") + str(target))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
