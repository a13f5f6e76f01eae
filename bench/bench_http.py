"""What the HTTP front adds to a request: the same requests, one at a time, through
`zpd.Client` (ZeroMQ straight to the router), through the HTTP front's asyncio router
client in this process (what `zpd http` adds before HTTP), and through `zpd http`
(POST /generate on a kept-alive connection, and streamed), on one `zpd launch
--http-port` cluster.

    python bench/bench_http.py [--model tiny] [--requests 200] [--new-tokens 1]
                               [--streams 64] [--stream-tokens 64] [--rounds 3]

Requests alternate between the paths, so a burst of other work on a shared machine
skews both. Latency: submit to the last byte of the answer, per request; the
table gives medians and p90 and the median difference, which is the front's cost
(parse, one more ZeroMQ hop, detokenize, format, HTTP).

Then load: --streams concurrent streamed requests of --stream-tokens each, all at once,
through `zpd.Client` and through HTTP (`POST /generate`, SSE), --rounds times each,
alternating: time to first token per request (p50, p99) and output tokens per second
over the round; the table gives medians over rounds, the TTFT the front adds, and the
ratio of throughputs.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.e2e.cluster import Cluster  # noqa: E402
from zpd.http.records import GenRequest  # noqa: E402
from zpd.http.router_client import RouterClient  # noqa: E402


class RawHTTP:
    """HTTP/1.1 POSTs on one kept-alive connection with no client library, so the
    figures are the front's cost rather than an HTTP client's (aiohttp's client costs
    about as much as the server per request)."""

    def __init__(self, endpoint: str) -> None:
        self.host, port = endpoint.rsplit(":", 1)
        self.port = int(port)
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, body: bytes, on_event=None) -> bytes:
        """The answer's body; for a chunked (SSE) answer, `on_event(chunk)` per chunk."""
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        self.writer.write(b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                          b"Content-Length: %d\r\n\r\n%s" % (path.encode(), self.host.encode(),
                                                              len(body), body))
        head = (await self.reader.readuntil(b"\r\n\r\n")).lower()
        if b"transfer-encoding: chunked" not in head:
            length = int(head.split(b"content-length:")[1].split(b"\r\n")[0])
            return await self.reader.readexactly(length)
        last = b""
        while True:
            size = int((await self.reader.readuntil(b"\r\n")).strip(), 16)
            data = await self.reader.readexactly(size + 2)
            if not size:
                return last
            last = data[:-2]
            if on_event is not None:
                on_event(last)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def run(cluster: Cluster, args: argparse.Namespace) -> dict[str, list[float]]:
    sampling = {"temperature": 0, "max_new_tokens": args.new_tokens, "ignore_eos": True}
    times: dict[str, list[float]] = {"zpd.Client": [], "asyncio client": [], "HTTP": [],
                                     "HTTP stream": []}
    router = RouterClient(cluster.router)
    await router.start()
    http = RawHTTP(cluster.info["http"])
    path = "/generate"
    with cluster.client() as client:
        for i in range(args.requests + args.warmup):
            ids = [(i * 7 + j) % 250 for j in range(args.prompt_len)]
            t0 = time.perf_counter()
            client.generate(input_ids=ids, sampling_params=sampling)
            t1 = time.perf_counter()
            async for _ in router.stream(GenRequest(sampling, input_ids=ids)):
                pass
            t1b = time.perf_counter()
            await http.post(path, orjson.dumps({"input_ids": ids, "sampling_params": sampling}))
            t2 = time.perf_counter()
            await http.post(path, orjson.dumps(
                {"input_ids": ids, "sampling_params": sampling, "stream": True}))
            t3 = time.perf_counter()
            if i >= args.warmup:
                for name, dt in zip(times, (t1 - t0, t1b - t1, t2 - t1b, t3 - t2)):
                    times[name].append(dt * 1e3)
    http.close()
    await router.close()
    return times


def zmq_round(cluster: Cluster, prompts: list[list[int]], sampling: dict) -> tuple[list[float], float]:
    """TTFTs (ms) and output tok/s of every prompt streamed at once through zpd.Client."""
    with cluster.client() as client:
        t0 = time.perf_counter()
        rids = {client.submit(input_ids=p, sampling_params=sampling, stream=True): i
                for i, p in enumerate(prompts)}
        first: dict[str, float] = {}
        tokens, left = 0, len(rids)
        while left:
            chunk = client.receive()
            if chunk["rid"] not in rids:
                continue
            tokens += len(chunk["token_ids"])
            if chunk["token_ids"] and chunk["rid"] not in first:
                first[chunk["rid"]] = time.perf_counter() - t0
            left -= chunk["finished"]
        took = time.perf_counter() - t0
    return [t * 1e3 for t in first.values()], tokens / took


async def http_round(endpoint: str, prompts: list[list[int]], sampling: dict) -> tuple[list[float], float]:
    """The same through HTTP: streamed POST /generate, every request at once, one
    connection each."""
    async def one(ids: list[int], t0: float) -> tuple[float, int]:
        http, first, last = RawHTTP(endpoint), [], [b""]

        def on_event(event: bytes) -> None:
            if event.startswith(b"data: {"):
                if not first:
                    first.append(time.perf_counter() - t0)
                last[0] = event
        body = orjson.dumps({"input_ids": ids, "sampling_params": sampling, "stream": True})
        try:
            await http.post("/generate", body, on_event)
        finally:
            http.close()
        return first[0] * 1e3, len(orjson.loads(last[0][6:])["output_ids"])   # cumulative

    t0 = time.perf_counter()
    got = await asyncio.gather(*(one(p, t0) for p in prompts))
    took = time.perf_counter() - t0
    return [t for t, _ in got], sum(n for _, n in got) / took


def load(cluster: Cluster, args: argparse.Namespace) -> None:
    sampling = {"temperature": 0, "max_new_tokens": args.stream_tokens, "ignore_eos": True}
    prompts = [[(i * 13 + j) % 250 for j in range(args.prompt_len)] for i in range(args.streams)]
    rows: dict[str, list[tuple[float, float, float]]] = {"zpd.Client": [], "HTTP": []}
    for _ in range(args.rounds):
        for name in rows:
            ttfts, rate = zmq_round(cluster, prompts, sampling) if name == "zpd.Client" else \
                asyncio.run(http_round(cluster.info["http"], prompts, sampling))
            rows[name].append((statistics.median(ttfts), percentile(ttfts, 0.99), rate))
    print(f"\n{args.streams} concurrent streams x {args.stream_tokens} tokens, "
          f"median of {args.rounds} rounds")
    print(f"{'path':<12}{'TTFT p50 ms':>13}{'TTFT p99 ms':>13}{'out tok/s':>11}")
    med = {name: [statistics.median(col) for col in zip(*r)] for name, r in rows.items()}
    for name, (p50, p99, rate) in med.items():
        print(f"{name:<12}{p50:>13.2f}{p99:>13.2f}{rate:>11.1f}")
    z, h = med["zpd.Client"], med["HTTP"]
    print(f"HTTP adds {h[0] - z[0]:.2f} ms TTFT at p50, {h[1] - z[1]:.2f} ms at p99; "
          f"tok/s ratio HTTP/zpd.Client {h[2] / z[2]:.3f}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=1)
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--stream-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
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
        if args.streams:
            load(cluster, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
