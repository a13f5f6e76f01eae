#!/usr/bin/env bash
# Start zpd's HTTP front (SGLang's and OpenAI's APIs) on this node. It execs python, so
# its pid is the front's pid.
set -euo pipefail

usage() {
  cat <<'EOF_USAGE'
usage: launch_http.sh --router H:P [options] [-- extra flags]

Start `zpd http` on this node (exec python3 -m zpd http ...): SGLang's native routes
and OpenAI's, as a client of a running zpd router. Each option also reads an
environment variable; a flag wins over the variable.

  --router H:P       ZPD_ROUTER      the zpd router's endpoint (required)
  --host IP          ZPD_HOST        interface to serve on (default 127.0.0.1)
  --port P           ZPD_PORT        HTTP port (default 30000, SGLang's)
  --model M          ZPD_MODEL       the cluster's model: its tokenizer and chat template
                                     (default tiny; its weights are not loaded)
  --curve-keys DIR   ZPD_CURVE_KEYS  the cluster's CURVE key directory (zpd keys)
  --insecure         ZPD_INSECURE=1  serve on a non-loopback --host without an API key
  --log-file F       ZPD_LOG_FILE    append stdout and stderr here (default: the terminal)
  --log-level L      ZPD_LOG_LEVEL   DEBUG, INFO, WARNING (default INFO)
  --python P         ZPD_PYTHON      python interpreter (default python3)
  -h, --help                         this text

The API keys are read from ZPD_API_KEY and ZPD_ADMIN_API_KEY in this process's
environment, or from files (--api-key-file F, --admin-api-key-file F, passed on), never
from the command line, which every local user can read. An admin key needs
--curve-keys (else any local process could send admin commands to the router
directly), or --insecure. Any other argument is passed to 'zpd http' unchanged, e.g.
--served-model-name NAME, --allowed-hosts NAME, --header-timeout S.
EOF_USAGE
}

router=${ZPD_ROUTER:-}; host=${ZPD_HOST:-127.0.0.1}; port=${ZPD_PORT:-30000}
model=${ZPD_MODEL:-tiny}; keys=${ZPD_CURVE_KEYS:-}; log_file=${ZPD_LOG_FILE:-}
log_level=${ZPD_LOG_LEVEL:-INFO}; python=${ZPD_PYTHON:-python3}; insecure=${ZPD_INSECURE:-}
extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --router) router=$2; shift 2;;
    --host) host=$2; shift 2;;
    --port) port=$2; shift 2;;
    --model) model=$2; shift 2;;
    --curve-keys) keys=$2; shift 2;;
    --insecure) insecure=1; shift;;
    --log-file) log_file=$2; shift 2;;
    --log-level) log_level=$2; shift 2;;
    --python) python=$2; shift 2;;
    -h|--help) usage; exit 0;;
    --) shift; extra+=("$@"); break;;
    *) extra+=("$1"); shift;;
  esac
done
[ -n "$router" ] || { echo "launch_http.sh: give --router H:P (or ZPD_ROUTER)" >&2; exit 2; }

cd "$(dirname "$0")/.."
argv=("$python" -m zpd http --router "$router" --host "$host" --port "$port" --model "$model"
      --log-level "$log_level")
[ -n "$keys" ] && argv+=(--curve-keys "$keys")
[ "$insecure" = 1 ] && argv+=(--insecure)
argv+=("${extra[@]}")
if [ -n "$log_file" ]; then
  mkdir -p "$(dirname "$log_file")"
  echo "$(date -u +%FT%TZ) launch_http.sh: ${argv[*]}" >>"$log_file"
  exec "${argv[@]}" >>"$log_file" 2>&1 </dev/null
fi
exec "${argv[@]}"
