#!/usr/bin/env bash
# Idempotent set-up of .venv-megatron/ at the repo root: the real megatron-core that
# tests/integrations/test_megatron.py drives through tests/integrations/megatron/mcore_tool.py.
#
# megatron-core lives in its own venv. From 0.17 it declares Python >= 3.12; the 0.19.2
# wheel works on 3.11 with --ignore-requires-python, numpy<2.5 and psutil (undeclared,
# needed to save) and triton (`import megatron.core` imports it). torch is pinned in the SAME pip command (otherwise pip resolves a CUDA
# build of several GB). nvidia-resiliency-ext is kept OUT: with it installed
# `import megatron.core` crashes. cloudckpt itself is not installed here: the tool imports
# it from the source tree (PYTHONPATH), so its runtime dependencies are installed beside
# megatron-core. The stamp is written only after both import; pip's output goes to
# .venv-megatron/setup.log (the tests print its tail when this script fails).
# Prints the venv's python on success (last line of stdout).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv-megatron
LOG=$VENV/setup.log
PKGS=("megatron-core==0.19.2" "torch==2.13.0" "numpy<2.5" "psutil" "triton" "packaging"
      "boto3>=1.36" "google-cloud-storage>=2.18" "google-crc32c>=1.5" "tqdm" "pyyaml" "pytest")
stamp=$VENV/.megatron-installed
if [ ! -f "$stamp" ] || [ scripts/setup_megatron_venv.sh -nt "$stamp" ] || [ ! -x "$VENV/bin/python" ] \
   || { [ -L "$VENV/shared-torch/torch" ] && [ ! -e "$VENV/shared-torch/torch" ]; }; then
  mkdir -p "$VENV"
  : >"$LOG"
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV" >>"$LOG" 2>&1
  "$VENV/bin/python" -m pip install --upgrade pip >>"$LOG" 2>&1
  bash scripts/share_torch.sh "$VENV" >>"$LOG" 2>&1
  "$VENV/bin/python" -m pip install --ignore-requires-python "${PKGS[@]}" >>"$LOG" 2>&1
  if "$VENV/bin/python" -m pip show nvidia-resiliency-ext >/dev/null 2>&1; then
    "$VENV/bin/python" -m pip uninstall -y nvidia-resiliency-ext >>"$LOG" 2>&1
  fi
  PYTHONPATH="$PWD" "$VENV/bin/python" -c "import torch, megatron.core, megatron.core.dist_checkpointing, cloudckpt.integrations.megatron; print('torch', torch.__version__, 'megatron-core', megatron.core.__version__)" >>"$LOG" 2>&1
  touch "$stamp"
fi
echo "$PWD/$VENV/bin/python"
