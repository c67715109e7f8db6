#!/usr/bin/env bash
# Idempotent set-up of the peer venvs that bench/run.py compares against, one venv
# per peer because their pins conflict with ours and with each other:
#
#   .venv-bench-olmo   ai2-olmo-core (torch < 2.14) + boto3 (its S3 client)
#   .venv-bench-s3tc   s3torchconnector[dcp] (S3StorageWriter / S3StorageReader)
#   .venv-bench-fsspec DCP's FsspecWriter/FsspecReader + s3fs (aiobotocore pins botocore)
#
# and the bench tools (matplotlib for the chart, psutil) in the main .venv.
# torch is ALWAYS pinned as torch==2.13.0 in the same pip command as anything that
# depends on torch: otherwise pip resolves the newest torch with several GB of CUDA
# packages. A peer that fails to install is reported by bench/run.py as
# "not installed" (with the reason from .venv-bench-logs/setup-<peer>.log).
#
#   bash bench/setup_peers.sh            # all peers
#   bash bench/setup_peers.sh olmo s3tc  # some
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH="torch==2.13.0"
mkdir -p .venv-bench-logs

declare -A PKGS=(
  [olmo]="ai2-olmo-core==3.0.0 boto3 $TORCH"
  [s3tc]="s3torchconnector[dcp]==1.5.0 numpy $TORCH"
  # s3fs pins aiobotocore, which pins botocore: let pip pick the matching trio, no boto3.
  [fsspec]="s3fs==2026.9.0 fsspec==2026.9.0 aiobotocore==3.10.0 botocore==1.43.117 numpy $TORCH"
)

install_tools() {
  if [ -x .venv/bin/python ] && ! .venv/bin/python -c "import matplotlib, psutil" 2>/dev/null; then
    echo "== bench tools (matplotlib, psutil) into .venv"
    .venv/bin/python -m pip install -q matplotlib psutil
  fi
}

setup_one() {
  local name=$1 venv=".venv-bench-$1" stamp log=".venv-bench-logs/setup-$1.log"
  stamp="$venv/.bench-installed"
  if [ -f "$stamp" ] && [ "$stamp" -nt bench/setup_peers.sh ]; then
    echo "== $name: up to date ($venv)"
    return 0
  fi
  echo "== $name: installing ${PKGS[$name]} into $venv (log: $log)"
  [ -x "$venv/bin/python" ] || "$PY" -m venv "$venv" >"$log" 2>&1
  if "$venv/bin/python" -m pip install -q --upgrade pip >>"$log" 2>&1 &&
     "$venv/bin/python" -m pip install ${PKGS[$name]} >>"$log" 2>&1; then
    "$venv/bin/python" -m pip freeze >"$venv/.bench-freeze.txt" 2>/dev/null
    touch "$stamp"
    echo "== $name: ok"
  else
    echo "== $name: FAILED (see $log)"
    return 1
  fi
}

install_tools
names=("$@")
[ ${#names[@]} -eq 0 ] && names=(olmo s3tc fsspec)
rc=0
for n in "${names[@]}"; do
  if [ -z "${PKGS[$n]+x}" ]; then echo "unknown peer $n (known: ${!PKGS[*]})"; rc=2; continue; fi
  setup_one "$n" || rc=1
done
exit $rc
