#!/usr/bin/env bash
# A whole local cluster answering a question: `zpd launch` (router + 1 prefill + 1 decode,
# KV moved by Mooncake over loopback TCP), then `zpd generate` against it, then the same
# request through `zpd run` (one process, the reference path); the two answers must match.
#   bash scripts/demo.sh [PROMPT] [extra zpd launch flags...]
# Environment: ZPD_MODEL (default smollm2; tiny needs no model file but answers noise),
#              PYTHON (default python3).
set -euo pipefail
PYTHON=${PYTHON:-python3}
MODEL=${ZPD_MODEL:-smollm2}
PROMPT=${1:-What is the capital of France?}
shift || true
# The tiny model has no chat template: its prompt goes in as plain text.
case "$MODEL" in tiny*) chat="" ;; *) chat="--chat" ;; esac
dir=$(mktemp -d)
trap 'kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null; rm -rf "$dir"' EXIT
"$PYTHON" -m zpd launch --model "$MODEL" --prefill 1 --decode 1 --port 0 \
  --ready-file "$dir/cluster.json" --log-dir "$dir/logs" "$@" &
pid=$!
for _ in $(seq 1 600); do
  [ -f "$dir/cluster.json" ] && break
  kill -0 "$pid" 2>/dev/null || { echo "zpd launch failed; logs:"; cat "$dir"/logs/* 2>/dev/null; exit 1; }
  sleep 0.2
done
[ -f "$dir/cluster.json" ] || { echo "cluster not ready after 120 s"; exit 1; }
router=$("$PYTHON" -c 'import json,sys; print(json.load(open(sys.argv[1]))["router"])' "$dir/cluster.json")
flags=(--prompt "$PROMPT" $chat --max-new-tokens 64 --temperature 0 --json)
echo "model $MODEL, question: $PROMPT"
"$PYTHON" -m zpd generate --router "$router" "${flags[@]}" > "$dir/cluster.out"
"$PYTHON" -m zpd run --model "$MODEL" "${flags[@]}" > "$dir/run.out"
"$PYTHON" - "$dir/cluster.out" "$dir/run.out" <<'PY'
import json, sys
cluster, run = (json.loads(open(p).read()) for p in sys.argv[1:3])
print(f"cluster (1 prefill + 1 decode): {cluster['text']!r}")
print(f"zpd run (one process):          {run['text']!r}")
same = cluster["output_ids"] == run["output_ids"]
print("identical token for token:", "yes" if same else "NO")
sys.exit(0 if same else 1)
PY
