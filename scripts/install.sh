#!/usr/bin/env bash
# Install zpd and what it needs on a Debian machine (run as root or with sudo).
#   bash scripts/install.sh          # runtime: system libraries, torch, zpd with Mooncake
#   bash scripts/install.sh --test   # also the test tools (pytest, transformers as reference)
# Environment: ZPD_MOONCAKE=cpu|cuda (default cpu: mooncake-transfer-engine-non-cuda),
#              ZPD_TORCH (default 2.13.0; pinned because an unpinned torch can pull a
#              multi-GB CUDA build), PYTHON (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
MOONCAKE=${ZPD_MOONCAKE:-cpu}
TORCH=${ZPD_TORCH:-2.13.0}
extras=$MOONCAKE
[ "${1:-}" = "--test" ] && extras="$extras,test"

# Mooncake's engine links libibverbs and libnuma even when it only uses TCP.
libs="libibverbs1 librdmacm1 libnuma1 iproute2 procps"
missing=$(for p in $libs; do dpkg -s "$p" >/dev/null 2>&1 || echo "$p"; done)
if [ -n "$missing" ]; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq $missing >/dev/null
fi
"$PYTHON" -m pip install -q "torch==$TORCH"
"$PYTHON" -m pip install -q -e ".[$extras]"
echo "zpd installed ($("$PYTHON" -c 'import torch; print("torch", torch.__version__)'), mooncake: $MOONCAKE)"
