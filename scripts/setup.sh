#!/usr/bin/env bash
# Idempotent set-up: a .venv with cloudckpt (editable), every extra the test suite
# imports (all = the s3, gcs and https backends; lightning; hf) and the test tools.
# torch is pinned in the same pip command as everything that needs it, so pip
# takes the CPU build on this machine instead of pulling CUDA packages.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.cloudckpt-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ scripts/setup.sh -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e ".[all,lightning,hf,test]" "torch==2.13.0"
  touch "$stamp"
fi
