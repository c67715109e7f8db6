#!/usr/bin/env bash
# Idempotent set-up of .venv-titan/ at the repo root: the real torchtitan that
# tests/integrations/test_torchtitan.py drives through tests/integrations/titan/titan_tool.py.
#
# torchtitan lives in its own venv: it pulls datasets, wandb, tensorboard, tyro and more
# that cloudckpt's .venv does not need. torch is pinned in the SAME pip command (otherwise
# pip resolves a CUDA build of several GB). cloudckpt itself is not installed here: the
# tool imports it from the source tree (PYTHONPATH), so its runtime dependencies are
# installed beside torchtitan. The stamp is written only after both import; pip's output
# goes to .venv-titan/setup.log (the tests print its tail when this script fails).
# Prints the venv's python on success (last line of stdout).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv-titan
LOG=$VENV/setup.log
PKGS=("torchtitan==0.3.0" "torch==2.13.0" "boto3>=1.36" "google-cloud-storage>=2.18" "google-crc32c>=1.5" "tqdm" "pyyaml")
stamp=$VENV/.titan-installed
if [ ! -f "$stamp" ] || [ scripts/setup_torchtitan_venv.sh -nt "$stamp" ] || [ ! -x "$VENV/bin/python" ] \
   || { [ -L "$VENV/shared-torch/torch" ] && [ ! -e "$VENV/shared-torch/torch" ]; }; then
  mkdir -p "$VENV"
  : >"$LOG"
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV" >>"$LOG" 2>&1
  "$VENV/bin/python" -m pip install --upgrade pip >>"$LOG" 2>&1
  bash scripts/share_torch.sh "$VENV" >>"$LOG" 2>&1
  "$VENV/bin/python" -m pip install "${PKGS[@]}" >>"$LOG" 2>&1
  PYTHONPATH="$PWD" "$VENV/bin/python" -c "import torch, torchtitan.components.checkpoint, cloudckpt.integrations.torchtitan; print('torch', torch.__version__)" >>"$LOG" 2>&1
  touch "$stamp"
fi
echo "$PWD/$VENV/bin/python"
