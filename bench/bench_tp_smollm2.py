"""SmolLM2-135M (9 query heads over 3 key/value heads) at `zpd run --tp 3` against
`--tp 1`: the same greedy tokens for the chat prompt of tests/unit/test_smollm2.py, and what
the three ranks cost here in wall-clock time. A script, not a test: 15-45 s on 2 busy
cores (every rank loads the whole model, then keeps its part):

    python bench/bench_tp_smollm2.py [--tp 3] [--new-tokens 16]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QUESTION = "What is the capital of France?"


def run(tp: int, new_tokens: int, dtype: str) -> tuple[dict, float]:
    argv = [sys.executable, "-m", "zpd", "run", "--model", "smollm2", "--chat", "--prompt", QUESTION,
            "--temperature", "0", "--max-new-tokens", str(new_tokens), "--dtype", dtype,
            "--json", "--tp", str(tp)]
    started = time.monotonic()
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        sys.exit(f"zpd run --tp {tp} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.splitlines()[0]), time.monotonic() - started


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=3, help="ranks to compare with one (default 3)")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    one, t1 = run(1, args.new_tokens, args.dtype)
    many, tn = run(args.tp, args.new_tokens, args.dtype)
    same = one["output_ids"] == many["output_ids"]
    print(f"SmolLM2 {args.dtype}, greedy, {args.new_tokens} new tokens: {one['text']!r}")
    print("| ranks | wall s (process start and model load included) | tokens |")
    print("|---|---|---|")
    print(f"| 1 | {t1:.1f} | {one['output_ids']} |")
    print(f"| {args.tp} | {tn:.1f} | {'the same' if same else many['output_ids']} |")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
