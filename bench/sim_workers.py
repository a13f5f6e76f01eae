"""A pool of simulated prefill and decode workers in ONE process, for measuring the
control plane (router, HTTP front) at cluster scale on a small machine: a real
null-engine worker costs about 530 MB and a torch import, so 64 decodes + 16 prefills
do not fit, but their endpoints do.

    python bench/sim_workers.py --decode 64 --prefill 16 --step-ms 20 --ready-file F

Each endpoint is its own ZeroMQ ROUTER socket speaking the real wire protocol
(zpd.wire.net, zpd.wire.protocol): Ping -> Pong, Admin `status` -> AdminReply, Abort
ends the request, and a Generate is answered the way a null-engine worker answers it
(engines/models/null.py's `predict` gives the tokens):

- its prefill "computes" the prompt in prefill_us per token, one prompt after another,
  and sends a streamed request's first token to the router (`Tokens`, first=True);
- its decode starts the request when that prefill is done (the KV "arrived"), sends
  the first token (streamed requests), then every step_ms one token of each running
  request, all of a step's in one step per router (a `Tokens` body per client,
  zpd/wire/step.py), as the real decode batches them (a mixture's step, `--experts TOTAL/ACTIVE`, takes the null model's
  time for its batch: engines/models/null_spec.py `NullSpec.step_s`); a non-streamed
  request's tokens come once, with its end.

What is not simulated: the prefill-decode link (KvDest, KvDone, the KV transfer),
pages, pause/retract, scoring. Those cost the workers, not the router or the front.

Control on stdin, one command a line: `dump PATH` writes the send times (monotonic
seconds, CLOCK_MONOTONIC is system-wide) of every streamed token so far as JSON
{rid: [t0, t1, ...]} and forgets them; `quit` ends the process.
"""
from __future__ import annotations

import argparse
import os
from abc import ABC, abstractmethod
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

import orjson
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engines.models.null import predict  # noqa: E402
from engines.models.null_spec import NullSpec  # noqa: E402
from zpd.wire.loop import Loop  # noqa: E402
from zpd.wire.net import Router  # noqa: E402
from zpd.wire.protocol import (Abort, Admin, AdminReply, Generate, Ping, Pong,  # noqa: E402
                               TokenPart, Tokens)
from zpd.wire.step import pack_step  # noqa: E402

VERSION = "null"                 # a null model's weight version with seed 0


@dataclass(eq=False)
class SimJob:
    """One request on a simulated decode."""
    rid: str
    client: bytes                # the router identity that sent it: answers go there
    prompt_len: int
    tokens: list[int]            # every output token, predicted up front
    stream: bool
    out: int = 0                 # tokens produced so far
    sent: int = 0                # tokens sent so far
    owner: str = ""              # the router's client (Generate.owner)


@dataclass
class Stamps:
    """When each streamed token left the pool, per rid (the bench's per-hop latency)."""
    on: bool
    sent: dict[str, list[float]] = field(default_factory=dict)

    def mark(self, rid: str, upto: int, now: float) -> None:
        if self.on:
            times = self.sent.setdefault(rid, [])
            times.extend([now] * (upto - len(times)))


class SimEndpoint(ABC):
    """One worker's socket and its liveness and status answers; a prefill or a decode
    says what it does with a Generate."""
    role = ""

    def __init__(self, pool: "SimPool", ctx: zmq.Context, host: str) -> None:
        self.pool, self.sock = pool, Router(ctx, host, 0)
        self.endpoint = self.sock.endpoint
        pool.loop.add_socket(self.sock, self.on_socket)

    def on_socket(self) -> None:
        got = self.sock.recv()
        if got is None:
            return
        identity, msg = got
        if isinstance(msg, Ping):
            self.sock.send(identity, Pong(msg.seq, msg.sent_at, self.endpoint))
        elif isinstance(msg, Admin):
            self.on_admin(identity, msg)
        elif isinstance(msg, Generate):
            self.on_generate(identity, msg)
        elif isinstance(msg, Abort):
            self.on_abort(identity, msg)

    def on_admin(self, identity: bytes, msg: Admin) -> None:
        ok = msg.command in ("status", "flush_cache")
        result = self.status() if ok else {"error": f"unknown command {msg.command!r}",
                                           "status": 400}
        self.sock.send(identity, AdminReply(msg.req_id, ok, {"endpoint": self.endpoint,
                                                             "role": self.role} | result))

    def status(self) -> dict:
        return {"weight_version": VERSION, "paused": None, "memory": "resident",
                "kv_pages": {"total": 1024, "free": 1024, "held": 0, "fenced": 0, "cached": 0},
                "queues": {"running": 0}}

    @abstractmethod
    def on_generate(self, identity: bytes, msg: Generate) -> None:
        """Take a routed request."""

    def on_abort(self, identity: bytes, msg: Abort) -> None:
        pass


class SimPrefill(SimEndpoint):
    """Computes prompts one after another; a streamed one's first token goes to the
    router when its prompt is done."""
    role = "prefill"

    def __init__(self, pool: "SimPool", ctx: zmq.Context, host: str) -> None:
        super().__init__(pool, ctx, host)
        self.busy_until = 0.0
        self.done_at: dict[str, float] = {}     # rid -> when its prompt is computed

    def finish_time(self, rid: str, prompt_len: int) -> float:
        """When `rid`'s prompt is done; the first of its prefill's and its decode's
        generate to arrive fixes it, the second takes it (and forgets it)."""
        at = self.done_at.pop(rid, None)
        if at is None:
            at = max(self.pool.loop.time(), self.busy_until) + prompt_len * self.pool.prefill_s
            self.busy_until = self.done_at[rid] = at
        return at

    def on_generate(self, identity: bytes, msg: Generate) -> None:
        at = self.finish_time(msg.rid, len(msg.input_ids))
        if msg.stream:
            first = self.pool.tokens(msg)[:1]
            self.pool.loop.call_at(at, self.send_first, identity, msg.rid, first)

    def send_first(self, identity: bytes, rid: str, first: list[int]) -> None:
        if first:
            self.pool.stamps.mark(rid, 1, self.pool.loop.time())
            self.sock.send(identity, Tokens.pack([TokenPart(rid, first, [VERSION], start=0)],
                                                 first=True))


class SimDecode(SimEndpoint):
    """Starts each request when its prefill is done; one step every step_ms for all
    its running requests, one Tokens message per router per step."""
    role = "decode"

    def __init__(self, pool: "SimPool", ctx: zmq.Context, host: str) -> None:
        super().__init__(pool, ctx, host)
        self.jobs: dict[str, SimJob] = {}
        self.running: dict[str, SimJob] = {}
        self.stepping = False

    def status(self) -> dict:
        return super().status() | {"queues": {"running": len(self.running)}}

    def on_generate(self, identity: bytes, msg: Generate) -> None:
        if msg.rid in self.jobs:
            self.sock.send(identity, Tokens.abort(msg.rid, 409, f"rid {msg.rid!r} is in flight"))
            return
        prefill = self.pool.prefills.get(msg.prefill)
        if prefill is None:
            self.sock.send(identity, Tokens.abort(msg.rid, 400, f"no prefill {msg.prefill!r}"))
            return
        job = SimJob(msg.rid, identity, len(msg.input_ids), self.pool.tokens(msg), msg.stream,
                     owner=msg.owner)
        self.jobs[msg.rid] = job
        self.pool.loop.call_at(prefill.finish_time(msg.rid, job.prompt_len), self.start, job)

    def start(self, job: SimJob) -> None:
        """The KV arrived with the first token (KvDone): stream it, then step."""
        if self.jobs.get(job.rid) is not job:
            return                                  # aborted meanwhile
        job.out = 1
        self.running[job.rid] = job
        self.emit({job.client: {job.owner: [self.part(job)]}}
                  if job.stream or job.out == len(job.tokens) else {})
        if not self.stepping:
            self.stepping = True
            self.pool.loop.call_later(self.pool.spec.step_s(len(self.running)), self.step)

    def step(self) -> None:
        by_client: dict[bytes, dict[str, list[TokenPart]]] = {}
        for job in list(self.running.values()):
            job.out += 1
            if job.stream or job.out >= len(job.tokens):
                by_client.setdefault(job.client, {}).setdefault(job.owner, []).append(self.part(job))
        self.emit(by_client)
        self.stepping = bool(self.running)
        if self.stepping:
            self.pool.loop.call_later(self.pool.spec.step_s(len(self.running)), self.step)

    def part(self, job: SimJob) -> TokenPart:
        """The job's tokens not yet sent, with its end once it has them all."""
        start = job.sent
        ids, job.sent = job.tokens[job.sent:job.out], job.out
        if job.stream:
            self.pool.stamps.mark(job.rid, job.out, self.pool.loop.time())
        if job.out < len(job.tokens):
            return TokenPart(job.rid, ids, [VERSION] * len(ids), start=start)
        self.forget(job.rid)
        n = len(job.tokens)
        meta = {"prompt_tokens": job.prompt_len, "completion_tokens": n, "retractions": 0,
                "cached_tokens": 0, "text": bytes(job.tokens).decode("latin-1")}
        return TokenPart(job.rid, ids, [VERSION] * len(ids), {"type": "length", "length": n}, meta,
                         start=start)

    def emit(self, by_client: dict[bytes, dict[str, list[TokenPart]]]) -> None:
        for router, owners in by_client.items():
            self.sock.send_frames(router, pack_step([Tokens.pack(p) for p in owners.values()]))

    def forget(self, rid: str) -> None:
        self.jobs.pop(rid, None)
        self.running.pop(rid, None)

    def on_abort(self, identity: bytes, msg: Abort) -> None:
        job = self.jobs.get(msg.rid)
        if job is not None:
            self.forget(msg.rid)
            self.sock.send(job.client, Tokens.abort(msg.rid, msg.status or 499,
                                                   msg.reason or "aborted"))


class SimPool:
    """Every simulated worker of the process, on one loop."""

    def __init__(self, decodes: int, prefills: int, step_ms: float, prefill_us: float,
                 host: str = "127.0.0.1", stamps: bool = True, seed: int = 0,
                 experts: str = "0/0") -> None:
        self.ctx, self.loop = zmq.Context(), Loop()
        self.spec = NullSpec.parse(f"null:step_ms={step_ms},experts={experts}")
        self.prefill_s, self.seed = prefill_us / 1e6, seed
        self.stamps = Stamps(stamps)
        self.prefills = {p.endpoint: p for p in (SimPrefill(self, self.ctx, host)
                                                 for _ in range(prefills))}
        self.decodes = [SimDecode(self, self.ctx, host) for _ in range(decodes)]

    def tokens(self, msg: Generate) -> list[int]:
        return predict(msg.input_ids, msg.sampling.max_new_tokens,
                       self.seed)

    def endpoints(self) -> dict:
        return {"prefill": list(self.prefills), "decode": [d.endpoint for d in self.decodes],
                "pid": os.getpid()}

    def on_command(self, line: str, stop: threading.Event) -> None:
        cmd, _, arg = line.strip().partition(" ")
        if cmd == "dump":
            sent, self.stamps.sent = self.stamps.sent, {}
            Path(arg).write_bytes(orjson.dumps(sent))
            print("dumped", flush=True)
        elif cmd == "quit" or not line:
            stop.set()

    def close(self) -> None:
        socks = [w.sock for w in [*self.prefills.values(), *self.decodes]]
        # a send dropped (a router's queue full) loses tokens: the bench must say so
        print(f"dropped sends: {sum(s.dropped_sends for s in socks)}", flush=True)
        for sock in socks:
            sock.close()
        self.loop.close()
        self.ctx.term()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--decode", type=int, default=1)
    p.add_argument("--prefill", type=int, default=1)
    p.add_argument("--step-ms", type=float, default=20.0)
    p.add_argument("--prefill-us", type=float, default=50.0)
    p.add_argument("--experts", default="0/0",
                   help="TOTAL/ACTIVE: a mixture's decode step, by the experts its batch reads")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--ready-file", required=True)
    args = p.parse_args()
    pool = SimPool(args.decode, args.prefill, args.step_ms, args.prefill_us, args.host,
                   experts=args.experts)
    stop = threading.Event()
    pool.loop.add_fd(sys.stdin.fileno(), lambda: pool.on_command(sys.stdin.readline(), stop))
    Path(args.ready_file).write_bytes(orjson.dumps(pool.endpoints()))
    try:
        pool.loop.run(stop)
    finally:
        pool.close()


if __name__ == "__main__":
    main()
