#!/usr/bin/env bash
# Run by Snakemake (`--sdm conda`) once, inside the freshly created env of envs/pipeline.yaml,
# from the directory Snakemake was started in: the repository root for
# `snakemake --profile slurm`. Set DPADAPTER_REPO when running from elsewhere.
# Editable, so the jobs always run the checked-out code (the env's hash covers only the pins).
set -euo pipefail
repo="${DPADAPTER_REPO:-$PWD}"
if [ ! -f "$repo/pyproject.toml" ] || [ ! -d "$repo/src/dpadapter" ]; then
  echo "pipeline.post-deploy.sh: $repo is not the dpadapter repository; set DPADAPTER_REPO" >&2
  exit 1
fi
python -m pip install --no-deps --no-build-isolation --disable-pip-version-check -e "$repo"
