"""A real router (in a thread, on loopback) in front of fake workers: the decode ends
each request it is sent `hold` seconds later with one token, in order of arrival; the
prefill takes requests and says nothing. For tests of what the router does with load
(queueing, fairness), where a model would only cost time."""
from __future__ import annotations

import heapq
import threading
import time
from dataclasses import replace

import zmq

from zpd.config import RouterConfig
from zpd.ops.router import build_router
from zpd.wire.net import Router
from zpd.wire.protocol import Generate, TokenPart, Tokens


class FakeDecode:
    """A bound ROUTER that finishes every Generate `hold` seconds after it arrives."""

    def __init__(self, ctx: zmq.Context, hold: float) -> None:
        self.sock = Router(ctx, "127.0.0.1", 0)
        self.endpoint, self.hold = self.sock.endpoint, hold
        self.seen: list[str] = []           # rids, in order of arrival
        self.most = 0                       # the most requests it held at once
        self.due: list[tuple[float, int, bytes, str]] = []

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            now = time.monotonic()
            while self.due and self.due[0][0] <= now:
                _, _, who, rid = heapq.heappop(self.due)
                self.sock.send(who, Tokens.pack([TokenPart(rid, [7], ["v"], {"type": "length"},
                                                           {"completion_tokens": 1})]))
            wait = min(0.05, self.due[0][0] - now) if self.due else 0.05
            got = self.sock.recv(timeout=max(0.0, wait))
            if got is not None and isinstance(got[1], Generate):
                self.seen.append(got[1].rid)
                heapq.heappush(self.due, (time.monotonic() + self.hold, len(self.seen), got[0],
                                          got[1].rid))
                self.most = max(self.most, len(self.due))


class FakeCluster:
    """Router + silent prefill + FakeDecode; `endpoint` is the router's."""

    def __init__(self, hold: float = 0.0, **router: object) -> None:
        self.ctx = zmq.Context()
        self.prefill = Router(self.ctx, "127.0.0.1", 0)
        self.decode = FakeDecode(self.ctx, hold)
        cfg = RouterConfig((self.prefill.endpoint,), (self.decode.endpoint,), port=0,
                           peer_timeout=600.0)
        self.router = build_router(replace(cfg, **router), self.ctx)
        self.endpoint = self.router.endpoint
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self.router.run, args=(self.stop,), daemon=True),
                        threading.Thread(target=self.decode.run, args=(self.stop,), daemon=True)]
        for t in self.threads:
            t.start()

    def close(self) -> None:
        self.stop.set()
        self.router.loop.stop()
        for t in self.threads:
            t.join(5)
        self.router.close()
        self.prefill.close()
        self.decode.sock.close()
        self.ctx.destroy(linger=0)
