#!/usr/bin/env bash
# A whole local cluster answering a request: `zpd launch` (router + 1 prefill + 1 decode,
# KV moved by Mooncake over loopback TCP), then `zpd generate` against it, then stop.
#   bash scripts/demo.sh [PROMPT] [extra zpd launch flags...]
# Environment: ZPD_MODEL (default tiny), PYTHON (default python3).
set -euo pipefail
PYTHON=${PYTHON:-python3}
PROMPT=${1:-Hello}
shift || true
dir=$(mktemp -d)
trap 'kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null; rm -rf "$dir"' EXIT
"$PYTHON" -m zpd launch --model "${ZPD_MODEL:-tiny}" --prefill 1 --decode 1 --port 0 \
  --ready-file "$dir/cluster.json" --log-dir "$dir/logs" "$@" &
pid=$!
for _ in $(seq 1 600); do
  [ -f "$dir/cluster.json" ] && break
  kill -0 "$pid" 2>/dev/null || { echo "zpd launch failed; logs:"; cat "$dir"/logs/* 2>/dev/null; exit 1; }
  sleep 0.2
done
[ -f "$dir/cluster.json" ] || { echo "cluster not ready after 120 s"; exit 1; }
router=$("$PYTHON" -c 'import json,sys; print(json.load(open(sys.argv[1]))["router"])' "$dir/cluster.json")
echo "--- zpd generate --router $router --prompt \"$PROMPT\" --max-new-tokens 32 --temperature 0"
"$PYTHON" -m zpd generate --router "$router" --prompt "$PROMPT" --max-new-tokens 32 --temperature 0 --json
echo "--- the same request through zpd run (one process, the reference path)"
"$PYTHON" -m zpd run --model "${ZPD_MODEL:-tiny}" --prompt "$PROMPT" --max-new-tokens 32 --temperature 0 --json
