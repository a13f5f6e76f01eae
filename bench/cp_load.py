"""The clients of bench_control_plane.py: closed-loop loads straight to the router
(ZeroMQ, the wire protocol itself, lean so the client is not what saturates) and
through the HTTP front (POST /generate, streamed, one kept-alive connection per
stream). Each request's tokens and when each arrived (monotonic seconds) are kept,
so tokens can be checked against the null model's `predict` and each hop's latency
taken against the simulated pool's send times."""
from __future__ import annotations

import asyncio
import itertools
import os
import random
import time
from dataclasses import dataclass, field

import orjson
import zmq

from bench_http import SSEConnection
from engines.models.null import predict
from engines.sampling_params import SamplingParams
from zpd.wire.net import Dealer
from zpd.wire.protocol import Generate, Tokens


@dataclass
class Spec:
    """One client: `concurrency` requests in flight, each sent as the last ends."""
    name: str
    concurrency: int
    max_new: int
    stream: bool = True
    prompt_len: int = 32
    spread: float = 0.0          # max_new_tokens varies by this fraction either way
    rate: float = 0.0            # > 0: sent at this many a second (at most `concurrency`
                                 # in flight) instead of each as the last ends

    def new_tokens(self, rng: random.Random) -> int:
        low, high = round(self.max_new * (1 - self.spread)), round(self.max_new * (1 + self.spread))
        return rng.randint(max(1, low), max(1, high))


@dataclass(eq=False)
class Req:
    rid: str
    prompt: list[int]
    max_new: int
    sent: float
    tokens: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)      # when each token arrived
    done: float = 0.0
    finish: dict | None = None

    def take(self, ids: list[int], now: float) -> None:
        self.tokens += ids
        self.times += [now] * len(ids)

    @property
    def ok(self) -> bool:
        return (self.finish or {}).get("type") == "length" and \
            self.tokens == predict(self.prompt, self.max_new)


@dataclass
class Result:
    """One client's requests, sent from `start`; those sent after `warm` are measured."""
    spec: Spec
    reqs: list[Req]
    start: float
    end: float

    @property
    def answered(self) -> bool:
        return all(r.finish is not None for r in self.reqs)

    def latencies(self, warm_s: float = 0.0) -> list[float]:
        """End-to-end seconds of each request sent after the warm-up."""
        return [r.done - r.sent for r in self.reqs if r.sent >= self.start + warm_s]

    def tokens(self) -> int:
        return sum(len(r.tokens) for r in self.reqs)


class Prompts:
    """Fresh random prompts (no prefix affinity to favour a worker)."""

    def __init__(self, seed: int) -> None:
        self.rng, self.ids = random.Random(seed), itertools.count()

    def next(self, spec: Spec, prefix: str) -> tuple[str, list[int]]:
        return (f"{prefix}-{next(self.ids)}",
                [self.rng.randrange(32, 127) for _ in range(spec.prompt_len)])


def sampling(max_new: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new, temperature=0, ignore_eos=True)


class ZmqLoad:
    """Several clients (one DEALER identity each) on one poll loop."""

    def __init__(self, router: str, specs: list[Spec], seed: int = 0) -> None:
        self.ctx, self.specs, self.prompts = zmq.Context(), specs, Prompts(seed)
        tag = f"{os.getpid()}-{seed}"
        self.dealers = [Dealer(self.ctx, router, identity=f"bench-{s.name}-{tag}".encode())
                        for s in specs]
        self.inflight: list[dict[str, Req]] = [{} for _ in specs]
        self.done: list[list[Req]] = [[] for _ in specs]

    def send(self, i: int) -> None:
        spec = self.specs[i]
        rid, prompt = self.prompts.next(spec, spec.name)
        new = spec.new_tokens(self.prompts.rng)
        self.inflight[i][rid] = Req(rid, prompt, new, time.monotonic())
        self.dealers[i].send(Generate(rid, prompt, sampling(new), spec.stream))

    def on_message(self, i: int) -> None:
        msg = self.dealers[i].recv()
        if not isinstance(msg, Tokens):
            return                     # Accepted, and the router's pings probing us
        now = time.monotonic()
        for part in msg.unpack():
            req = self.inflight[i].get(part.rid)
            if req is None:
                continue
            ids = part.token_ids             # less those it has (each part says its start)
            if part.start is not None and part.start < len(req.tokens):
                ids = ids[len(req.tokens) - part.start:]
            req.take(ids, now)
            if part.finished:
                req.finish, req.done = part.finish, now
                self.done[i].append(self.inflight[i].pop(part.rid))
                if now < self.stop_at and not self.specs[i].rate:
                    self.send(i)

    def paced(self, now: float) -> float:
        """Send what the paced clients owe by `now`; seconds until the next is due."""
        wait = 0.1
        for i, spec in enumerate(self.specs):
            if not spec.rate or now >= self.stop_at:
                continue
            while self.due[i] <= now and len(self.inflight[i]) < spec.concurrency:
                self.send(i)
                self.due[i] += 1 / spec.rate
            wait = min(wait, max(0.0, self.due[i] - now))
        return wait

    def run(self, duration: float, drain_s: float = 20.0) -> list[Result]:
        """Send for `duration` seconds, then wait (at most `drain_s`) for every answer."""
        start = time.monotonic()
        self.stop_at, self.due = start + duration, [start] * len(self.specs)
        for i, spec in enumerate(self.specs):
            for _ in range(0 if spec.rate else spec.concurrency):
                self.send(i)
        poller = zmq.Poller()
        for d in self.dealers:
            poller.register(d.socket, zmq.POLLIN)
        index = {d.socket: i for i, d in enumerate(self.dealers)}
        give_up = self.stop_at + drain_s
        while (any(self.inflight) or time.monotonic() < self.stop_at) and \
                time.monotonic() < give_up:
            for sock, _ in poller.poll(self.paced(time.monotonic()) * 1e3):
                for _ in range(64):
                    if not sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                        break
                    self.on_message(index[sock])
        end = time.monotonic()
        return [Result(s, self.done[i] + list(self.inflight[i].values()), start, end)
                for i, s in enumerate(self.specs)]

    def close(self) -> None:
        for d in self.dealers:
            d.close()
        self.ctx.term()


class HttpLoad:
    """`concurrency` streams of POST /generate (incremental SSE events) to the front."""

    def __init__(self, front: str, spec: Spec, seed: int = 0) -> None:
        self.front, self.spec, self.prompts = front, spec, Prompts(seed)
        self.reqs: list[Req] = []

    async def stream(self, conn: SSEConnection, stop_at: float) -> None:
        while time.monotonic() < stop_at:
            rid, prompt = self.prompts.next(self.spec, "http")
            req = Req(rid, prompt, self.spec.max_new, time.monotonic())
            self.reqs.append(req)
            body = orjson.dumps({"rid": rid, "input_ids": prompt, "stream": True,
                                 "sampling_params": sampling(self.spec.max_new).to_wire()})
            await conn.post("/generate", body, lambda data, r=req: self.on_event(r, data))

    def on_event(self, req: Req, data: bytes) -> None:
        now = time.monotonic()
        for line in data.split(b"\n\n"):
            if not line.startswith(b"data: {"):
                continue
            event = orjson.loads(line[6:])
            req.take(event.get("output_ids") or [], now)
            finish = event.get("meta_info", {}).get("finish_reason")
            if finish:
                req.finish, req.done = finish, now

    async def main(self, duration: float) -> Result:
        start = time.monotonic()
        conns = [await SSEConnection.open(self.front) for _ in range(self.spec.concurrency)]
        try:
            await asyncio.gather(*(self.stream(c, start + duration) for c in conns))
        finally:
            for c in conns:
                c.transport.close()
        return Result(self.spec, self.reqs, start, time.monotonic())

    def run(self, duration: float) -> Result:
        return asyncio.run(self.main(duration))
