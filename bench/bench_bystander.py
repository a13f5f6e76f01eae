"""A bystander beside one big HTTP call (issue 43: audit 2's held-out check), through
`zpd launch --http-port` on the tiny model:

caller A sends one POST /v1/completions of 8 prompts x n=128 (1,024 generations,
--max-tokens each); --settle seconds later a bystander from the same address (so the
same HTTP user: keyless callers on one host are one user) sends one POST /generate
(4 new tokens) and one POST /v1/completions (1 prompt, 4 tokens). Printed: each
bystander call's latency, and A's own.

    python bench/bench_bystander.py [--max-tokens 16] [--settle 1] [--rounds 3]
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run without install

from common import http_post as post  # noqa: E402
from tests.e2e.cluster import Cluster  # noqa: E402

BYSTANDER_WAIT_S = 60       # the bystander's calls give up after this long


async def timed(endpoint: str, path: str, body: dict, limit: float) -> float:
    """Seconds to the answer; `limit` if none came by then."""
    start = time.monotonic()
    try:
        status, answer = await asyncio.wait_for(post(endpoint, path, body), limit)
    except TimeoutError:
        return limit
    if status != 200:
        raise RuntimeError(f"{path} answered {status}: {answer}")
    return time.monotonic() - start


async def one_round(http: str, args: argparse.Namespace) -> dict[str, float]:
    big = {"prompt": [f"prompt number {i}" for i in range(8)], "n": 128,
           "max_tokens": args.max_tokens, "temperature": 1.0}
    a = asyncio.create_task(timed(http, "/v1/completions", big, 600))
    await asyncio.sleep(args.settle)
    gen = {"text": "hello", "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    comp = {"prompt": "hello", "max_tokens": 4, "temperature": 0}
    got = await asyncio.gather(timed(http, "/generate", gen, BYSTANDER_WAIT_S),
                               timed(http, "/v1/completions", comp, BYSTANDER_WAIT_S))
    return {"generate": got[0], "completions": got[1], "big call": await a}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--settle", type=float, default=1.0)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp, \
            Cluster(Path(tmp), dtype="float32",
                    extra=("--http-port", "0", "--log-level", "WARNING")) as cluster:
        http = cluster.info["http"]
        rounds = [asyncio.run(one_round(http, args)) for _ in range(args.rounds)]
    for name in ("generate", "completions", "big call"):
        values = [r[name] for r in rounds]
        print(f"{name:<12} seconds per round {', '.join(f'{v:.2f}' for v in values)}; "
              f"median {statistics.median(values):.2f}")
    print(f"(a bystander's {BYSTANDER_WAIT_S:.2f}: no answer by then)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
