#!/usr/bin/env bash
# The one preparation step for the lent GPU machine (a bare image with torch, torchvision and
# timm; no package index, no Debian dataset): run here, where PyPI is reachable, after
# `make setup`, in the repository root:
#   bash bench/gpu/gpu_wheels.sh
# It writes two folders, both ignored by git, that the device call carries (docs/gpu.md):
#   .whl/     wheels of what bench/gpu/gpu_session.sh imports beyond the image: Opacus,
#             dp-accounting, jsonschema and Snakemake, each with every dependency the image
#             lacks, at the versions installed in .venv (the pins of requirements.txt), for
#             CPython 3.12 on x86-64. The list is computed from .venv's metadata, minus the
#             image's own distributions (bench/gpu/gpu_image_packages.txt) and minus PuLP
#             (Snakemake's optional ILP scheduler, 17 MB of solver binaries: without it
#             Snakemake schedules greedily). MLflow is not carried: tracking switches itself
#             off where it is missing.
#   .fmnist/  Fashion-MNIST's four .gz files (about 30 MB), from Debian's package.
# Prints their sizes; the working tree plus both must stay under the 64 MiB a call may send.
set -euo pipefail
cd "$(dirname "$0")/../.."
[ -x .venv/bin/python ] || { echo "run 'make setup' first: the versions come from .venv" >&2; exit 2; }
mapfile -t pins < <(.venv/bin/python - bench/gpu/gpu_image_packages.txt <<'PY'
import importlib.metadata as md, re, sys
from packaging.requirements import Requirement

norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
image = {norm(x) for x in open(sys.argv[1]).read().split() if not x.startswith("#")}
skip = image | {"pulp"}
# the markers of the GPU image's interpreter (Python 3.12 on Linux, x86-64)
env = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
       "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
       "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}
seen = {}
def walk(name):
    n = norm(name)
    if n in seen or n in skip:
        return
    seen[n] = md.version(name)
    for r in md.distribution(name).requires or []:
        req = Requirement(r)
        if req.marker is None or req.marker.evaluate(env):
            walk(req.name)
for top in ("opacus", "dp-accounting", "jsonschema", "snakemake"):
    walk(top)
print("\n".join(f"{n}=={v}" for n, v in sorted(seen.items())))
PY
)
platforms=()
for n in 39 35 34 31 28 27 24 17; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
platforms+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
rm -rf .whl && mkdir -p .whl
for pin in "${pins[@]}"; do
  # a wheel where PyPI has one for CPython 3.12; else (a pure-Python sdist) one built here
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${platforms[@]}" -d .whl "$pin" 2>/dev/null \
    || python3 -m pip wheel -q --no-deps -w .whl "$pin"
done
src=${FMNIST_SRC:-/usr/share/datasets/fashion-mnist}
mkdir -p .fmnist
for f in train-images-idx3-ubyte train-labels-idx1-ubyte t10k-images-idx3-ubyte t10k-labels-idx1-ubyte; do
  cp "$src/$f.gz" .fmnist/
done
echo "${#pins[@]} distributions in .whl/"
du -sh .whl .fmnist
echo "sent with the working tree: $(git ls-files -z | du -ch --files0-from=- | tail -1 | cut -f1) tracked + the two above"
