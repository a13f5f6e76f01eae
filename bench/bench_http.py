"""What the HTTP front adds to a request: the same requests, one at a time, through
`zpd.Client` (ZeroMQ straight to the router), through the HTTP front's asyncio router
client in this process (what `zpd http` adds before HTTP), and through `zpd http`
(POST /generate on a kept-alive connection, and streamed), on one `zpd launch
--http-port` cluster.

    python bench/bench_http.py [--model tiny] [--requests 200] [--new-tokens 1]

Requests alternate between the paths, so a burst of other work on a shared machine
skews both. Latency: submit to the last byte of the answer, per request; the
table gives medians and p90 and the median difference, which is the front's cost
(parse, one more ZeroMQ hop, detokenize, format, HTTP).
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.e2e.cluster import Cluster  # noqa: E402
from zpd.http.records import GenRequest  # noqa: E402
from zpd.http.router_client import RouterClient  # noqa: E402


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def run(cluster: Cluster, args: argparse.Namespace) -> dict[str, list[float]]:
    url = f"http://{cluster.info['http']}/generate"
    sampling = {"temperature": 0, "max_new_tokens": args.new_tokens, "ignore_eos": True}
    times: dict[str, list[float]] = {"zpd.Client": [], "asyncio client": [], "HTTP": [],
                                     "HTTP stream": []}
    router = RouterClient(cluster.router)
    await router.start()
    with cluster.client() as client:
        async with aiohttp.ClientSession() as http:
            for i in range(args.requests + args.warmup):
                ids = [(i * 7 + j) % 250 for j in range(args.prompt_len)]
                t0 = time.perf_counter()
                client.generate(input_ids=ids, sampling_params=sampling)
                t1 = time.perf_counter()
                async for _ in router.stream(GenRequest(sampling, input_ids=ids)):
                    pass
                t1b = time.perf_counter()
                async with http.post(url, data=orjson.dumps(
                        {"input_ids": ids, "sampling_params": sampling})) as r:
                    await r.read()
                t2 = time.perf_counter()
                async with http.post(url, data=orjson.dumps(
                        {"input_ids": ids, "sampling_params": sampling, "stream": True})) as r:
                    await r.read()
                t3 = time.perf_counter()
                if i >= args.warmup:
                    for name, dt in zip(times, (t1 - t0, t1b - t1, t2 - t1b, t3 - t2)):
                        times[name].append(dt * 1e3)
    await router.close()
    return times


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=1)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp, \
            Cluster(Path(tmp), model=args.model, dtype="float32",
                    extra=("--http-port", "0", "--log-level", "WARNING")) as cluster:
        times = asyncio.run(run(cluster, args))
    base = statistics.median(times["zpd.Client"])
    print(f"{args.requests} requests, prompt {args.prompt_len} tokens, {args.new_tokens} new, "
          f"model {args.model}")
    print(f"{'path':<14}{'median ms':>11}{'p90 ms':>9}{'added ms':>10}")
    for name, xs in times.items():
        med = statistics.median(xs)
        print(f"{name:<14}{med:>11.3f}{percentile(xs, 0.9):>9.3f}{med - base:>10.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
