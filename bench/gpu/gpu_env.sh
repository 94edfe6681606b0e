# The one set-up of every GPU script (bench/gpu/gpu_*.sh source it; run bench/gpu/gpu_*.py after it:
# `source bench/gpu/gpu_env.sh && "$py" bench/gpu/gpu_X.py`). Works unchanged on a cluster GPU node
# with the project's venv (`make setup`) and on a bare GPU image that has only torch,
# torchvision and timm (the lent H100/H200), given what bench/gpu/gpu_wheels.sh put in the tree:
#   .whl/     the wheels the image lacks, installed to /tmp/site, skipping any package the
#             interpreter already has (the image's own attrs, numpy, ... stay as they are);
#   .fmnist/  Fashion-MNIST's four .gz files, used when Debian's package is absent
#             (FMNIST_DIR, read by dpadapter.data.sources; set it to use another folder).
# Sets `py` (the interpreter), PYTHONPATH (src/ first) and FMNIST_DIR; prints one line of what
# it found. Tracking: MLflow is off on a node without it (tracking.enabled: auto).
if [ -n "${PYTHON:-}" ]; then
  py="$PYTHON"
elif [ -x .venv/bin/python ]; then
  py=.venv/bin/python
else
  py=python3
fi
if [ "$py" != .venv/bin/python ] && [ -d .whl ]; then
  # Only the wheels whose distribution the interpreter lacks: a carried copy of a package the
  # image has (at another version) would shadow it from /tmp/site.
  mapfile -t _wheels < <("$py" - .whl/*.whl <<'PY'
import importlib.metadata as md, os, re, sys
for path in sys.argv[1:]:
    name = re.sub(r"[-_.]+", "-", os.path.basename(path).split("-")[0]).lower()
    try:
        md.version(name)
    except md.PackageNotFoundError:
        print(path)
PY
)
  if [ "${#_wheels[@]}" -gt 0 ]; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site "${_wheels[@]}" || { echo "gpu_env: wheel install failed" >&2; return 1 2>/dev/null || exit 1; }
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
  fi
  unset _wheels
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if [ -z "${FMNIST_DIR:-}" ] && [ ! -e /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ] \
  && [ -e .fmnist/train-images-idx3-ubyte.gz ]; then
  export FMNIST_DIR="$PWD/.fmnist"
fi
echo "gpu_env: python $("$py" -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.cuda.is_available())' 2>&1)," \
  "Fashion-MNIST from ${FMNIST_DIR:-/usr/share/datasets/fashion-mnist}"
