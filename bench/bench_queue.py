"""Load that queues instead of failing (issue 30), through `zpd launch --http-port` on
the tiny model:

(a) --requests concurrent POST /generate (one connection each, all open at once;
    --new-tokens each): how many answered anything but a finished generation
    (target 0), and every KV page back afterwards (the router's status: free +
    cached == total on every worker, nothing held or fenced).
(b) fairness: caller B's --batch concurrent requests, latency of each from its send
    to its answer, alone and then while caller A floods: --flood-calls HTTP calls in
    flight, each of 8 prompts x n (--flood generations; the call of issue 30 item 5),
    the next sent as each ends. A and B connect from different loopback addresses
    (127.0.0.2, 127.0.0.3), which the front names to the router as two callers.
    Target: B's median with the flood within 2x of B's median alone. The same again
    for B through zpd.Client (its own connection to the router, no HTTP front): the
    router's fairness without the front's share of the CPU. And once as A itself (from
    A's address): one caller's requests in arrival order, the wait fairness saves.

    python bench/bench_queue.py [--requests 10000] [--new-tokens 8] [--batch 8]
                                [--flood 1024] [--flood-calls 2] [--rounds 5]
                                [--decode 1]
                                [--max-concurrent-requests 0]

Both parts run on one cluster in one run; on a machine shared with other work the
fairness ratio moves with it, so each figure is a median over --rounds rounds.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import random
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run without install

from common import http_post, log_step  # noqa: E402
from tests.e2e.cluster import Cluster  # noqa: E402
from zpd.client import Client  # noqa: E402

A_ADDR, B_ADDR = "127.0.0.2", "127.0.0.3"
CONNECTING = 256           # connections being opened at once (the front's accept backlog)


def body(new_tokens: int, rng: random.Random) -> dict:
    return {"input_ids": [rng.randrange(1, 200) for _ in range(8)],
            "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0,
                                "ignore_eos": True}}


def outcome(status: int, answer: dict | None) -> str:
    if status != 200 or not isinstance(answer, dict):
        return f"HTTP {status}"
    finish = answer.get("meta_info", {}).get("finish_reason") or {}
    return "ok" if finish.get("type") in ("length", "stop") else f"abort {finish.get('status_code')}"


async def many(endpoint: str, n: int, new_tokens: int) -> tuple[collections.Counter, float]:
    rng, opening = random.Random(1), asyncio.Semaphore(CONNECTING)
    start = time.monotonic()
    got = await asyncio.gather(*(http_post(endpoint, "/generate", body(new_tokens, rng), opening=opening)
                                 for _ in range(n)), return_exceptions=True)
    took = time.monotonic() - start
    counts = collections.Counter(f"{type(g).__name__}" if isinstance(g, BaseException)
                                 else outcome(*g) for g in got)
    return counts, took


async def timed(endpoint: str, local: str, payload: dict) -> float:
    start = time.monotonic()
    status, answer = await http_post(endpoint, "/generate", payload, local)
    if outcome(status, answer) != "ok":
        raise RuntimeError(f"B's request failed: {status} {answer}")
    return time.monotonic() - start


async def b_batch(endpoint: str, args: argparse.Namespace, rng: random.Random,
                  local: str = B_ADDR) -> list[float]:
    return list(await asyncio.gather(*(timed(endpoint, local, body(args.new_tokens, rng))
                                       for _ in range(args.batch))))


def zmq_batch(router: str, args: argparse.Namespace, rng: random.Random) -> list[float]:
    """B's batch through zpd.Client (a connection of its own: the router's first level
    of fairness, without the HTTP front): each request's latency, every round."""
    out = []
    with Client(router, timeout=120) as client:
        for _ in range(args.rounds):
            start = time.monotonic()
            rids = [client.submit(**body(args.new_tokens, rng)) for _ in range(args.batch)]
            left = set(rids)
            while left:
                chunk = client.receive()
                if chunk["finished"] and chunk["rid"] in left:
                    left.discard(chunk["rid"])
                    out.append(time.monotonic() - start)
    return out


async def fairness(endpoint: str, router: str, args: argparse.Namespace) -> dict[str, float]:
    """B's median latency over HTTP and over zpd.Client, alone and under A's flood, and
    A's generations done meanwhile."""
    rng = random.Random(2)
    got = {"http alone": statistics.median(
        [t for _ in range(args.rounds) for t in await b_batch(endpoint, args, rng)])}
    got["zmq alone"] = statistics.median(await asyncio.to_thread(zmq_batch, router, args, rng))
    stop, done = asyncio.Event(), [0]

    async def a_calls() -> None:
        """One HTTP call of 8 prompts x n (issue 30 item 5's), again as each ends."""
        arng = random.Random(rng.random())
        while not stop.is_set():
            call = {"input_ids": [body(0, arng)["input_ids"] for _ in range(8)],
                    "sampling_params": {"max_new_tokens": args.new_tokens, "ignore_eos": True,
                                        "n": args.flood // 8}}
            status, answer = await http_post(endpoint, "/generate", call, A_ADDR)
            if status != 200:
                raise RuntimeError(f"A's call failed: {status} {answer}")
            done[0] += len(answer)
    flooding = [asyncio.create_task(a_calls()) for _ in range(args.flood_calls)]
    await asyncio.sleep(args.settle)                  # the flood fills the router's queue
    flooded = []
    for _ in range(args.rounds):
        flooded += await b_batch(endpoint, args, rng)
    got["http flooded"] = statistics.median(flooded)
    # the same requests as A's own: they queue behind A's, as every request did before
    got["same caller"] = statistics.median(await b_batch(endpoint, args, rng, A_ADDR))
    got["zmq flooded"] = statistics.median(await asyncio.to_thread(zmq_batch, router, args, rng))
    stop.set()
    await asyncio.gather(*flooding)
    return got | {"a_done": done[0]}


def pages(router: str) -> list[dict]:
    """Each worker's KV pages once idle (polls: the last answers may precede a free)."""
    with Client(router, timeout=60) as client:
        for _ in range(100):
            workers = client.admin("status", timeout=30)["workers"]
            if all(w["kv_pages"]["free"] + w["kv_pages"]["cached"] == w["kv_pages"]["total"]
                   and not w["kv_pages"]["held"] and not w["kv_pages"]["fenced"] for w in workers):
                break
            time.sleep(0.1)
    return [{"role": w["role"]} | w["kv_pages"] for w in workers]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=10_000)
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--batch", type=int, default=8, help="B's concurrent requests per round")
    p.add_argument("--flood", type=int, default=1024,
                   help="generations in each of A's calls (8 prompts x n = flood / 8)")
    p.add_argument("--flood-calls", type=int, default=2, help="A's calls kept in flight")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--settle", type=float, default=3.0,
                   help="seconds the flood runs before B's first round")
    p.add_argument("--decode", type=int, default=1)
    p.add_argument("--max-concurrent-requests", type=int, default=0,
                   help="the router's (default 0: zpd launch's, --max-batch x decodes)")
    args = p.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # one descriptor per connection here, and in the front (which inherits the limit and
    # takes connections up to three quarters of it)
    need = max(args.requests * 4 // 3, args.requests + 1024)
    if hard != resource.RLIM_INFINITY and hard < need:
        p.error(f"needs {need} file descriptors; the hard limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, need), hard))
    with tempfile.TemporaryDirectory() as tmp, \
            Cluster(Path(tmp), decode=args.decode, dtype="float32",
                    extra=("--http-port", "0", "--log-level", "WARNING", "--max-concurrent-requests",
                           str(args.max_concurrent_requests))) as cluster:
        http = cluster.info["http"]
        log_step(f"(a) {args.requests} concurrent POST /generate, {args.new_tokens} new tokens each")
        counts, took = asyncio.run(many(http, args.requests, args.new_tokens))
        refused = args.requests - counts["ok"]
        print(f"(a) {args.requests} concurrent requests in {took:.1f} s: {counts['ok']} served, "
              f"{refused} refused or failed {dict(counts - collections.Counter(ok=counts['ok']))}")
        for w in pages(cluster.router):
            print(f"    {w['role']:<8} pages total {w['total']}, free {w['free']}, cached "
                  f"{w['cached']}, held {w['held']}, fenced {w['fenced']}")
        log_step(f"(b) B: {args.batch} requests x {args.rounds} rounds, alone, then with A's "
                 f"{args.flood_calls} calls of {args.flood} in flight")
        got = asyncio.run(fairness(http, cluster.router, args))
        for path in ("http", "zmq"):
            alone, flooded = got[f"{path} alone"], got[f"{path} flooded"]
            print(f"(b) B over {path}: median latency alone {alone * 1e3:.0f} ms, with A "
                  f"flooding {flooded * 1e3:.0f} ms: ratio {flooded / alone:.2f} (target <= 2)")
        print(f"    B's batch sent as A (one caller, no one to take turns with): median "
              f"{got['same caller'] * 1e3:.0f} ms; A finished {got['a_done']} generations "
              "meanwhile")
        for w in pages(cluster.router):
            print(f"    {w['role']:<8} pages total {w['total']}, free {w['free']}, cached "
                  f"{w['cached']}, held {w['held']}, fenced {w['fenced']}")
    return 0 if refused == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
