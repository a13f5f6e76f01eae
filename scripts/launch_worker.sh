#!/usr/bin/env bash
# Start one zpd worker on this node: launch_prefill.sh and launch_decode.sh call
# this with their role. It execs python, so its pid is the worker's pid.
set -euo pipefail

role=${1:?usage: launch_worker.sh prefill|decode [options]}
shift
case "$role" in prefill|decode) ;; *) echo "launch_worker.sh: role must be prefill or decode" >&2; exit 2;; esac
[ "$role" = prefill ] && default_port=5760 || default_port=5770

usage() {
  cat <<EOF
usage: launch_$role.sh [options] [-- extra zpd $role flags]

Start a zpd $role worker on this node (exec python3 -m zpd $role ...).
Each option also reads an environment variable; a flag wins over the variable.

  --host IP          ZPD_HOST        interface to bind and to announce (default 127.0.0.1;
                                     on a cluster: this node's address on the cluster network)
  --port P           ZPD_PORT        ZeroMQ port (default $default_port)
  --model M          ZPD_MODEL       HF-format model directory or 'tiny' (default tiny)
  --device D         ZPD_DEVICE      cpu or cuda[:N] (default cpu)
  --dtype T          ZPD_DTYPE       float32, bfloat16, float16, float64 (default float32)
  --ib-device NAMES  ZPD_IB_DEVICE   RDMA NIC name(s) for Mooncake, e.g. mlx5_0 (default: auto)
  --protocol P       ZPD_PROTOCOL    Mooncake protocol: rdma or tcp (default tcp; Mooncake uses
                                     RDMA whenever RDMA NICs exist, MC_FORCE_TCP=1 forces TCP)
  --kv-cache-mb MB   ZPD_KV_CACHE_MB KV pool size in MiB (default 256)
  --curve-keys DIR   ZPD_CURVE_KEYS  CURVE key directory (zpd keys); default plaintext
  --router-secret-file F ZPD_ROUTER_SECRET_FILE  without --curve-keys: the file (0600) whose
                                     secret the cluster's routers prove themselves with; the
                                     same file on every router and worker (launch_cluster.sh
                                     makes one)
  --insecure         ZPD_INSECURE=1  serve plaintext on a non-loopback --host; without it (or
                                     --curve-keys) a worker refuses to bind one
  --log-file F       ZPD_LOG_FILE    append stdout and stderr here (default: the terminal)
  --log-level L      ZPD_LOG_LEVEL   DEBUG, INFO (a line per request event), WARNING (default INFO)
  --python P         ZPD_PYTHON      python interpreter (default python3)
  -h, --help                         this text

Any other argument is passed to 'zpd $role' unchanged (see 'python3 -m zpd $role --help'),
e.g. --threads 4 --max-batch 128 --transfer-timeout 10.
EOF
}

host=${ZPD_HOST:-127.0.0.1}; port=${ZPD_PORT:-$default_port}; model=${ZPD_MODEL:-tiny}
device=${ZPD_DEVICE:-cpu}; dtype=${ZPD_DTYPE:-float32}; ib=${ZPD_IB_DEVICE:-}
protocol=${ZPD_PROTOCOL:-tcp}; kv=${ZPD_KV_CACHE_MB:-}; keys=${ZPD_CURVE_KEYS:-}
secret=${ZPD_ROUTER_SECRET_FILE:-}
log_file=${ZPD_LOG_FILE:-}; log_level=${ZPD_LOG_LEVEL:-INFO}; python=${ZPD_PYTHON:-python3}
insecure=${ZPD_INSECURE:-}
extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --host) host=$2; shift 2;;
    --port) port=$2; shift 2;;
    --model) model=$2; shift 2;;
    --device) device=$2; shift 2;;
    --dtype) dtype=$2; shift 2;;
    --ib-device) ib=$2; shift 2;;
    --protocol) protocol=$2; shift 2;;
    --kv-cache-mb) kv=$2; shift 2;;
    --curve-keys) keys=$2; shift 2;;
    --router-secret-file) secret=$2; shift 2;;
    --insecure) insecure=1; shift;;
    --log-file) log_file=$2; shift 2;;
    --log-level) log_level=$2; shift 2;;
    --python) python=$2; shift 2;;
    -h|--help) usage; exit 0;;
    --) shift; extra+=("$@"); break;;
    *) extra+=("$1"); shift;;
  esac
done

# Run from the checkout so `-m zpd` works without installing it.
cd "$(dirname "$0")/.."
argv=("$python" -m zpd "$role" --host "$host" --port "$port" --model "$model" --device "$device"
      --dtype "$dtype" --protocol "$protocol" --log-level "$log_level")
[ -n "$ib" ] && argv+=(--ib-device "$ib")
[ -n "$kv" ] && argv+=(--kv-cache-mb "$kv")
[ -n "$keys" ] && argv+=(--curve-keys "$keys")
[ -n "$secret" ] && argv+=(--router-secret-file "$secret")
[ "$insecure" = 1 ] && argv+=(--insecure)
argv+=("${extra[@]}")
if [ -n "$log_file" ]; then
  mkdir -p "$(dirname "$log_file")"
  echo "$(date -u +%FT%TZ) launch_$role.sh: ${argv[*]}" >>"$log_file"
  exec "${argv[@]}" >>"$log_file" 2>&1 </dev/null
fi
exec "${argv[@]}"
