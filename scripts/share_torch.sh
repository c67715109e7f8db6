#!/usr/bin/env bash
# Usage: scripts/share_torch.sh VENV
# Lets the integration venv VENV use the torch of .venv (the same torch==2.13.0 CPU
# build) instead of unpacking a second 750 MB copy: VENV's site-packages gets a .pth
# naming VENV/shared-torch/, which holds links to .venv's torch, torchgen, functorch and
# torch's dist-info, so that pip sees torch==2.13.0 installed and installs only what
# else the venv needs (torch's small dependencies included). Nothing else of .venv is
# visible in VENV. Does nothing (exit 0) when .venv has no torch 2.13.0 or another
# Python: the caller's pip command then installs torch as before.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=$1
[ -x .venv/bin/python ] || exit 0
src=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
dst=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
mine=$("$VENV/bin/python" -c 'import sys; print(sys.version_info[:2])')
theirs=$(.venv/bin/python -c 'import sys; print(sys.version_info[:2])')
info=$(ls -d "$src"/torch-2.13.0*.dist-info 2>/dev/null | head -n 1)
if [ -z "$info" ] || [ "$mine" != "$theirs" ]; then
  exit 0
fi
mkdir -p "$VENV/shared-torch"
for name in torch torchgen functorch "$(basename "$info")"; do
  ln -sfn "$src/$name" "$VENV/shared-torch/$name"
done
echo "$PWD/$VENV/shared-torch" >"$dst/cloudckpt-shared-torch.pth"
