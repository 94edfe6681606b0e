# Sourced by the bench/gpu_*.sh scripts: sets `py` to the project's venv interpreter, or on a
# machine without one (the lent GPU image) to python3 with the wheels carried in .whl/
# (bench/gpu_wheels.sh makes them) installed to /tmp/site; puts src/ on PYTHONPATH.
if [ -n "${PYTHON:-}" ]; then
  py="$PYTHON"
elif [ -x .venv/bin/python ]; then
  py=.venv/bin/python
else
  py=python3
  if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
  fi
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
