"""What the HTTP front adds to a request: the same requests, one at a time, through
`zpd.Client` (ZeroMQ straight to the router), through the HTTP front's asyncio router
client in this process (what `zpd http` adds before HTTP), and through `zpd http`
(POST /generate on a kept-alive connection, and streamed), on one `zpd launch
--http-port` cluster.

    python bench/bench_http.py [--model tiny] [--requests 200] [--new-tokens 1]
                               [--streams 64] [--stream-tokens 64] [--duration 5]
                               [--rounds 3]

Requests alternate between the paths, so a burst of other work on a shared machine
skews both. Latency: submit to the last byte of the answer, per request; the
table gives medians and p90 and the median difference, which is the front's cost
(parse, one more ZeroMQ hop, detokenize, format, HTTP).

Then load, in steady state: --streams concurrent streams for --duration seconds, each
sending its next streamed request as soon as its last one ends (a closed loop, as an
RL rollout or a pooled OpenAI client keeps its concurrency), through `zpd.Client` and
through HTTP (`POST /generate`, SSE, one kept-alive connection per stream),
alternating, --rounds times each. Time to first token per request, from its own
send (requests sent in the first --warmup-s seconds of a round are left out: they
queue behind the burst that opens it), and output tokens per second over the round.
The table gives medians over rounds, the TTFT the front adds, and the ratio of
throughputs. Prompts are random ids, fresh for every request, so the prefix cache
does not favour either path.

--cpu instead measures the front's CPU per token, over simulated workers, against
another revision's front with --baseline REV (bench/front_cpu.py says how).

The HTTP client reads answers in its transport's callback (an asyncio Protocol, no
task switch per event), as lean as the `zpd.Client` loop on the other side: on this
machine the client shares the cores with the cluster, and a heavier client would be
counted against the front.
"""
from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engines.sampling_params import SamplingParams
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
            async for _ in router.stream(GenRequest(SamplingParams.from_dict(sampling), input_ids=ids)):
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


class SSEConnection(asyncio.Protocol):
    """One kept-alive HTTP/1.1 connection whose streamed (chunked) answers are parsed in
    `data_received`: each event costs the client a callback, not a task switch."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = b""
        self.state, self.size = "head", 0
        self.on_event = None
        self.done: asyncio.Future | None = None

    @classmethod
    async def open(cls, endpoint: str) -> "SSEConnection":
        host, port = endpoint.rsplit(":", 1)
        _, conn = await asyncio.get_running_loop().create_connection(cls, host, int(port))
        conn.host = host.encode()            # a keyless front refuses a foreign Host (403)
        return conn

    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        if self.done is not None and not self.done.done():
            self.done.set_exception(ConnectionError("the front closed the connection"))

    async def post(self, path: str, body: bytes, on_event) -> None:
        """Send one request; `on_event(data)` per chunk of its answer until the last (a
        whole answer, not streamed, is one chunk)."""
        self.on_event, self.done = on_event, asyncio.get_running_loop().create_future()
        self.transport.write(b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (path.encode(), self.host, len(body), body))
        await self.done

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while self._step():
            pass

    def _step(self) -> bool:
        """Take one piece of the answer off the buffer; False when more is needed."""
        if self.state == "head":
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return False
            head = self.buf[:end].lower()
            if b"transfer-encoding: chunked" not in head:       # a whole answer: one "event"
                self.size = int(head.split(b"content-length:")[1].split(b"\r\n")[0])
                if len(self.buf) < end + 4 + self.size:
                    return False
                self.on_event(self.buf[end + 4:end + 4 + self.size])
                self.buf = self.buf[end + 4 + self.size:]
                self.done.set_result(None)
                return True
            self.buf, self.state = self.buf[end + 4:], "size"
        elif self.state == "size":
            end = self.buf.find(b"\r\n")
            if end < 0:
                return False
            self.size, self.buf, self.state = int(self.buf[:end], 16), self.buf[end + 2:], "data"
        else:
            if len(self.buf) < self.size + 2:
                return False
            data, self.buf, self.state = self.buf[:self.size], self.buf[self.size + 2:], "size"
            if not self.size:
                self.state = "head"
                self.done.set_result(None)
            else:
                self.on_event(data)
        return True


class Tally:
    """One round's figures: TTFT per request (ms; only requests sent after the warm-up),
    and output tokens over the round."""

    def __init__(self, warmup_s: float, duration: float, seed: int, prompt_len: int) -> None:
        self.t0 = time.perf_counter()
        self.warm_at, self.stop_at = self.t0 + warmup_s, self.t0 + duration
        self.rng, self.prompt_len = random.Random(seed), prompt_len
        self.ttfts: list[float] = []
        self.tokens = 0

    def prompt(self) -> list[int]:
        return [self.rng.randrange(250) for _ in range(self.prompt_len)]

    def first(self, sent: float, now: float) -> None:
        if sent >= self.warm_at:
            self.ttfts.append((now - sent) * 1e3)

    def result(self) -> tuple[list[float], float]:
        return self.ttfts, self.tokens / (time.perf_counter() - self.t0)


def zmq_round(cluster: Cluster, args: argparse.Namespace, sampling: dict,
              seed: int) -> tuple[list[float], float]:
    """Closed-loop streams through zpd.Client: TTFTs (ms) and output tok/s."""
    with cluster.client() as client:
        tally = Tally(args.warmup_s, args.duration, seed, args.prompt_len)
        sent: dict[str, float] = {}
        first: set[str] = set()

        def send() -> None:
            sent[client.submit(input_ids=tally.prompt(), sampling_params=sampling,
                               stream=True)] = time.perf_counter()
        for _ in range(args.streams):
            send()
        while sent:
            chunk = client.receive()
            rid = chunk["rid"]
            if rid not in sent:
                continue
            tally.tokens += len(chunk["token_ids"])
            if chunk["token_ids"] and rid not in first:
                first.add(rid)
                tally.first(sent[rid], time.perf_counter())
            if chunk["finished"]:
                del sent[rid]
                first.discard(rid)
                if time.perf_counter() < tally.stop_at:
                    send()
        return tally.result()


async def http_round(endpoint: str, args: argparse.Namespace, sampling: dict,
                     seed: int) -> tuple[list[float], float]:
    """The same through HTTP: streamed POST /generate, one connection per stream."""
    tally = Tally(args.warmup_s, args.duration, seed, args.prompt_len)

    async def stream(conn: SSEConnection) -> None:
        while time.perf_counter() < tally.stop_at:
            sent, last = time.perf_counter(), [b""]

            def on_event(data: bytes) -> None:         # a chunk: one event or more
                if data.startswith(b"data: {"):
                    if not last[0]:
                        tally.first(sent, time.perf_counter())
                    last[0] = data
            body = orjson.dumps({"input_ids": tally.prompt(), "sampling_params": sampling,
                                 "stream": True})
            await conn.post("/generate", body, on_event)
            event = last[0].rstrip(b"\n").rsplit(b"\n\n", 1)[-1]    # a chunk may hold several
            tally.tokens += len(orjson.loads(event[len(b"data: "):])["output_ids"])  # cumulative
        conn.transport.close()

    conns = [await SSEConnection.open(endpoint) for _ in range(args.streams)]
    tally.t0 = time.perf_counter()        # connections are open, as a pooled client's are
    tally.warm_at, tally.stop_at = tally.t0 + args.warmup_s, tally.t0 + args.duration
    await asyncio.gather(*(stream(c) for c in conns))
    return tally.result()


def load(cluster: Cluster, args: argparse.Namespace) -> None:
    sampling = {"temperature": 0, "max_new_tokens": args.stream_tokens, "ignore_eos": True}
    rows: dict[str, list[tuple[float, float, float]]] = {"zpd.Client": [], "HTTP": []}
    for r in range(args.rounds):
        for name in rows:
            seed = 2 * r + (name == "HTTP")
            ttfts, rate = zmq_round(cluster, args, sampling, seed) if name == "zpd.Client" else \
                asyncio.run(http_round(cluster.info["http"], args, sampling, seed))
            rows[name].append((statistics.median(ttfts), percentile(ttfts, 0.99), rate))
            print(f"  round {r + 1} {name:<11} TTFT p50 {rows[name][-1][0]:7.2f} ms  "
                  f"p99 {rows[name][-1][1]:7.2f} ms  {rate:9.1f} tok/s ({len(ttfts)} requests)")
    print(f"\n{args.streams} concurrent streams (closed loop, {args.duration:g} s) x "
          f"{args.stream_tokens} tokens, median of {args.rounds} rounds")
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
    p.add_argument("--duration", type=float, default=5.0,
                   help="seconds each load round keeps sending (default 5)")
    p.add_argument("--warmup-s", type=float, default=0.5,
                   help="TTFTs of requests sent this early in a round are left out")
    p.add_argument("--rounds", type=int, default=3)
    cpu = p.add_argument_group("--cpu: the front's CPU per token (bench/front_cpu.py)")
    cpu.add_argument("--cpu", action="store_true",
                     help="measure the front's CPU per token over simulated workers instead")
    cpu.add_argument("--baseline", default="", metavar="REV",
                     help="also run the front of git revision REV, side by side")
    cpu.add_argument("--loads", default="generate,incremental,chat,whole")
    cpu.add_argument("--cpu-tokens", type=int, default=500, help="new tokens per request")
    cpu.add_argument("--decodes", type=int, default=2)
    cpu.add_argument("--step-ms", type=float, default=2.0)
    cpu.add_argument("--prefill-us", type=float, default=20.0)
    cpu.add_argument("--profile", default="", metavar="FILE",
                     help="run each front under cProfile, its stats in FILE.VARIANT")
    args = p.parse_args()
    if args.cpu:
        from front_cpu import run_cpu
        return run_cpu(args)
    if args.streams and not 0 <= args.warmup_s < args.duration:
        p.error("--warmup-s must be at least 0 and less than --duration")
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
