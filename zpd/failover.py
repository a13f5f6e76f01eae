"""Several routers behind one client: which takes the next request, which takes admin
commands, and which are down (issue 34, item 3). `zpd.Client` and the HTTP front's
router client (zpd/http/router_client.py) both follow this policy; they own the sockets.

- Each client sends its requests to one router, its own, while that one is up: a
  random one, or for the fronts of `zpd http --workers N` front i's is router i mod
  the routers, so 2 fronts over 2 routers split the load evenly. One router per
  client keeps each router's token messages to it batched (spread request by
  request, each front's tokens came in four streams, not two, and the routers took
  about a fifth more CPU per request: docs/http.md).
- A router is down once its connection drops (the socket monitor's event), once it
  leaves a request unacknowledged for the connect timeout, or once it falls silent
  with requests in flight. New requests go to the next router up, and so does one it
  never acknowledged (it never started). Its requests in flight wait for it to come
  back on its port (resumed: zpd/wire/resume.py) for the client's router silence,
  then end with 503: never a hang. A router whose connection dropped, or that failed
  before it ever connected, is tried again when it (re)connects; one down with its
  connection up (frozen), after RETRY_S. With every router down, requests still go
  to the one that may be tried soonest: one router alone behaves as it always did.
- Admin commands go to one router, the first of the list that is up, never to all:
  the routers' coordinator makes pauses and weight pushes atomic across the pool,
  and finds an aborted rid on any router (zpd/router/ha/peers.py); a follower passes
  such commands on to it. `status` alone (`FANNED`) goes to every router up: the
  first one's reply (the workers are the same pool for every router), with the
  routers' own figures (requests in flight and queued, the counters) summed over
  the routers that answered and each listed under "routers".
  A fanned command waits its whole timeout for the first router only, PEER_WAIT_S
  for the others: a frozen second router does not hold up /health or a status.
"""
from __future__ import annotations

import random
from typing import Collection, Sequence

import zmq
from zmq.utils.monitor import parse_monitor_message

from zpd.wire.net import INPROC, format_endpoint, parse_endpoint

RETRY_S = 5.0           # a router down for silence or no acknowledgement is tried after
FANNED = frozenset({"status"})          # read-only, and each router counts its own
PEER_WAIT_S = 2.0       # a FANNED command waits this long for the routers but the first
LINK_EVENTS = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED


def parse_routers(spec: str | Sequence[str]) -> tuple[str, ...]:
    """Router endpoints from "h:p,h:p" or a list of "h:p"; ValueError on a bad one,
    a repeated one or none."""
    parts = spec.split(",") if isinstance(spec, str) else list(spec)
    endpoints = tuple(_endpoint(p.strip()) for p in parts if p.strip())
    if not endpoints:
        raise ValueError("give at least one router endpoint (host:port)")
    if len(set(endpoints)) != len(endpoints):
        raise ValueError(f"a router is named twice in {','.join(endpoints)}")
    return endpoints


def _endpoint(text: str) -> str:
    return text if text.startswith(INPROC) else format_endpoint(*parse_endpoint(text))


class Routers:
    """The routers of one client and which of them are up (indexes into `endpoints`).
    Time is passed in (a monotonic clock in seconds), so tests need no sleeps."""

    def __init__(self, endpoints: Sequence[str], first: int | None = None,
                 retry_s: float = RETRY_S) -> None:
        self.endpoints = tuple(endpoints)
        self.retry_s = retry_s
        self.first = random.randrange(len(self.endpoints)) if first is None \
            else first % len(self.endpoints)          # this client's own router
        self._down_until: dict[int, float] = {}     # silent or unacknowledging: until then
        self._unplugged: set[int] = set()           # down, no connection: until it has one
        self._connected: set[int] = set()           # a connection is up (socket monitor)

    def __len__(self) -> int:
        return len(self.endpoints)

    def up(self, i: int, now: float) -> bool:
        return i not in self._unplugged and self._down_until.get(i, 0.0) <= now

    def pick(self, now: float, avoid: Collection[int] = ()) -> int | None:
        """The router for a new request: this client's own, else the next up after it
        in the list, not in `avoid`; with none up, the one that may be tried soonest;
        None once every router is in `avoid`."""
        order = [(self.first + k) % len(self) for k in range(len(self))]
        left = [i for i in order if i not in avoid]
        if not left:
            return None
        i = next((i for i in left if self.up(i, now)), None)
        return min(left, key=self._retry_at) if i is None else i

    def next_up(self, now: float, avoid: Collection[int]) -> int | None:
        """The router a request that `avoid` did not acknowledge goes to: one up, else None."""
        i = self.pick(now, avoid)
        return i if i is not None and self.up(i, now) else None

    def coordinator(self, now: float) -> int:
        """Where pool-wide admin commands go: the first router up in list order."""
        return next((i for i in range(len(self)) if self.up(i, now)),
                    min(range(len(self)), key=self._retry_at))

    def fanned(self, now: float) -> list[int]:
        """Where aborts go: every router up (every router when none is)."""
        return [i for i in range(len(self)) if self.up(i, now)] or list(range(len(self)))

    def down(self, i: int, now: float) -> None:
        """Router `i` failed a request or fell silent: skip it for `retry_s`, or until
        it connects where it has no connection (nothing listens there: waiting out
        connect timeouts every `retry_s` would delay one request each time)."""
        self._down_until[i] = now + self.retry_s
        if i not in self._connected:
            self._unplugged.add(i)

    def heard(self, i: int) -> None:
        """Router `i` spoke: it is up."""
        self._down_until.pop(i, None)
        self._unplugged.discard(i)
        self._connected.add(i)

    def link_event(self, i: int, event: int) -> bool:
        """Note a socket monitor event of router `i`'s connection; True when it dropped."""
        if event == zmq.EVENT_DISCONNECTED:
            self._unplugged.add(i)
            self._connected.discard(i)
            return True
        if event == zmq.EVENT_CONNECTED:        # back (or a new process): try it again
            self.heard(i)
        return False

    def _retry_at(self, i: int) -> float:
        return self._down_until.get(i, 0.0) + (1e9 if i in self._unplugged else 0.0)


def monitor_event(frames: list[bytes]) -> int:
    """The event number of one message of a socket monitor (`LINK_EVENTS`)."""
    return parse_monitor_message(frames)["event"]


def merge_replies(command: str, replies: list[dict]) -> dict:
    """One reply for a FANNED command from every router's, the first router's first."""
    return replies[0] if len(replies) == 1 else merge_status(replies)


def merge_status(replies: list[dict]) -> dict:
    """Several routers' status as one: the first that answered (the coordinator, when
    it did), with each router's own figures summed over those that answered."""
    answered = [r for r in replies if r.get("ok") or r.get("workers")] or replies[:1]
    merged = dict(answered[0])
    for key in ("inflight", "queued"):
        merged[key] = sum(r.get(key) for r in answered if type(r.get(key)) is int)
    merged["counters"] = _summed([r.get("counters") for r in answered])
    merged["routers"] = [{k: r.get(k) for k in ("router", "ok", "paused", "inflight", "queued")}
                         for r in replies]
    return merged


def _summed(counters: list[object]) -> dict:
    """Counter dicts added key by key (numbers, and dicts of numbers one level down)."""
    out: dict = {}
    for c in counters:
        for key, value in (c.items() if isinstance(c, dict) else ()):
            if isinstance(value, dict):
                out[key] = _summed([out.get(key, {}), value])
            elif type(value) in (int, float) and type(out.get(key, 0)) in (int, float):
                out[key] = out.get(key, 0) + value
    return out

