#!/usr/bin/env bash
# Idempotent set-up of .venv-checkov/ at the repo root, with checkov in it.
#
# checkov lives in its own venv because it pins an older boto3/botocore than
# cloudckpt needs; installing it into .venv would downgrade them.
# Prints the path of the checkov executable on success (last line of stdout).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv-checkov
stamp=$VENV/.checkov-installed
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
if [ ! -f "$stamp" ] || [ scripts/checkov_venv.sh -nt "$stamp" ] || [ ! -x "$VENV/bin/checkov" ]; then
  "$VENV/bin/python" -m pip install -q --upgrade pip >&2
  "$VENV/bin/python" -m pip install -q "checkov>=3.2,<4" >&2
  touch "$stamp"
fi
echo "$PWD/$VENV/bin/checkov"
