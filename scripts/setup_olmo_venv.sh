#!/usr/bin/env bash
# Idempotent set-up of .venv-olmo/ at the repo root: the real OLMo-core that
# tests/integrations/test_olmo_core.py drives through small scripts.
#
# OLMo-core lives in its own venv: it pins torch below what cloudckpt may use, and
# the interop tests must run its code, not ours. torch is pinned in the SAME pip
# command (otherwise pip resolves a CUDA build of several GB). boto3 is OLMo-core's
# S3 client. The stamp is written only after `import olmo_core` works; pip's output
# goes to .venv-olmo/setup.log (the tests print its tail when this script fails).
# Prints the venv's python on success (last line of stdout).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv-olmo
LOG=$VENV/setup.log
PKGS=("ai2-olmo-core==3.0.0" "boto3" "torch==2.13.0")
stamp=$VENV/.olmo-installed
if [ ! -f "$stamp" ] || [ scripts/setup_olmo_venv.sh -nt "$stamp" ] || [ ! -x "$VENV/bin/python" ] \
   || { [ -L "$VENV/shared-torch/torch" ] && [ ! -e "$VENV/shared-torch/torch" ]; }; then
  mkdir -p "$VENV"
  : >"$LOG"
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV" >>"$LOG" 2>&1
  "$VENV/bin/python" -m pip install --upgrade pip >>"$LOG" 2>&1
  bash scripts/share_torch.sh "$VENV" >>"$LOG" 2>&1
  "$VENV/bin/python" -m pip install "${PKGS[@]}" >>"$LOG" 2>&1
  "$VENV/bin/python" -c "import torch, olmo_core.train.checkpoint; print('torch', torch.__version__)" >>"$LOG" 2>&1
  touch "$stamp"
fi
echo "$PWD/$VENV/bin/python"
