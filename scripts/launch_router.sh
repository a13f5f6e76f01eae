#!/usr/bin/env bash
# Start the zpd router on this node. It execs python, so its pid is the router's pid.
set -euo pipefail

usage() {
  cat <<'EOF'
usage: launch_router.sh --prefill H:P[,H:P...] --decode H:P[,H:P...] [options] [-- extra flags]

Start the zpd router on this node (exec python3 -m zpd router ...). Clients and
`zpd admin` connect to it. Each option also reads an environment variable; a flag
wins over the variable.

  --prefill EPS      ZPD_PREFILL     prefill worker endpoints, comma-separated (required)
  --decode EPS       ZPD_DECODE      decode worker endpoints, comma-separated (required)
  --host IP          ZPD_HOST        interface to bind (default 127.0.0.1; 0.0.0.0 is not
                                     recommended: bind the cluster network's address)
  --port P           ZPD_PORT        port (default 5757)
  --curve-keys DIR   ZPD_CURVE_KEYS  CURVE key directory (zpd keys); default plaintext
  --router-secret-file F ZPD_ROUTER_SECRET_FILE  without --curve-keys: the file (0600) whose
                                     secret the cluster's routers prove themselves with; the
                                     same file on every router and worker (launch_cluster.sh
                                     makes one)
  --insecure         ZPD_INSECURE=1  serve plaintext on a non-loopback --host; without it (or
                                     --curve-keys) the router refuses to bind one
  --log-file F       ZPD_LOG_FILE    append stdout and stderr here (default: the terminal)
  --log-level L      ZPD_LOG_LEVEL   DEBUG, INFO (a line per request), WARNING (default INFO)
  --python P         ZPD_PYTHON      python interpreter (default python3)
  -h, --help                         this text

Any other argument is passed to 'zpd router' unchanged.
EOF
}

prefill=${ZPD_PREFILL:-}; decode=${ZPD_DECODE:-}; host=${ZPD_HOST:-127.0.0.1}
port=${ZPD_PORT:-5757}; keys=${ZPD_CURVE_KEYS:-}
secret=${ZPD_ROUTER_SECRET_FILE:-}; log_file=${ZPD_LOG_FILE:-}
log_level=${ZPD_LOG_LEVEL:-INFO}; python=${ZPD_PYTHON:-python3}; insecure=${ZPD_INSECURE:-}
extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --prefill) prefill=$2; shift 2;;
    --decode) decode=$2; shift 2;;
    --host) host=$2; shift 2;;
    --port) port=$2; shift 2;;
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
if [ -z "$prefill" ] || [ -z "$decode" ]; then
  echo "launch_router.sh: give --prefill and --decode endpoints (or ZPD_PREFILL/ZPD_DECODE)" >&2
  exit 2
fi

cd "$(dirname "$0")/.."
argv=("$python" -m zpd router --prefill "$prefill" --decode "$decode" --host "$host"
      --port "$port" --log-level "$log_level")
[ -n "$keys" ] && argv+=(--curve-keys "$keys")
[ -n "$secret" ] && argv+=(--router-secret-file "$secret")
[ "$insecure" = 1 ] && argv+=(--insecure)
argv+=("${extra[@]}")
if [ -n "$log_file" ]; then
  mkdir -p "$(dirname "$log_file")"
  echo "$(date -u +%FT%TZ) launch_router.sh: ${argv[*]}" >>"$log_file"
  exec "${argv[@]}" >>"$log_file" 2>&1 </dev/null
fi
exec "${argv[@]}"
