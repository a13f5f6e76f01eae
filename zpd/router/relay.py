"""The router's relay of a worker's step (zpd/wire/step.py): each body goes on to its
client as it came, after a check that reads its header alone.

The check, per rid of the body: a request in flight here, answered by the worker that
sent it (its decode), of the same client as every other rid of the body. Then the
body's frames go to that client unread; the client drops what it has already (each
part says where it starts: zpd/wire/resume.py). The router's bookkeeping needs only
the header: token counts (a request's first decode tokens take it off its prefill's
load; the tokens the prefill sent ahead are not counted twice) and the ends (the
request leaves, its share and loads are given back). A body that fails the check, any
step while an adopted request waits for its client, and a scoring request's answer
(from its prefill) go the slow way: decoded and settled part by part
(`RouterServer.relay`), which drops what the sender may not send.
"""
from __future__ import annotations

import logging
from typing import Any, Protocol, Sequence

from zpd.router.flights import InFlight, Worker
from zpd.router.hooks import Restart
from zpd.router.shares import ClientShares
from zpd.router.tally import Tally
from zpd.wire.net import Router
from zpd.wire.protocol import Message, ProtocolError, Rows, TokenPart, Tokens, decode
from zpd.wire.step import Peek, bodies, header_of, peek

log = logging.getLogger("zpd.router.relay")


class Server(Protocol):
    """What the relay reads and changes of its router (zpd/router/server.py)."""
    inflight: dict[str, InFlight]
    adoption: Restart | None
    shares: ClientShares
    tally: Tally
    front: Router

    def dispatch(self) -> None: ...

    def client_gone(self, client: bytes) -> None: ...

    def to_client(self, client: bytes, msg: Message) -> None: ...



class Relay:
    def __init__(self, server: Server) -> None:
        self.server = server
        self.fast = 0           # bodies passed on unread
        self.slow = 0           # bodies decoded and settled part by part

    def step(self, sender: Worker, frames: Sequence[Any]) -> None:
        try:
            got = bodies(header_of(frames[0]), frames)
        except ProtocolError as e:
            self._malformed(sender, e)
            return
        for body in got:
            self.body(sender, body)
        self.server.dispatch()               # finished requests made room

    def body(self, sender: Worker, body: Sequence[Any]) -> None:
        try:
            seen = peek(body)
        except ProtocolError as e:
            self._malformed(sender, e)
            return
        flights = self._check(sender, seen)
        if flights is None:
            self._slow(sender, body)
            return
        self.fast += 1
        server = self.server
        dup = 0
        for flight, n in zip(flights, seen.counts):
            start = flight.from_decode
            flight.from_decode = start + n
            if n and not flight.prefilled:   # the decode has the KV: prefill's part is done
                flight.prefilled = True
                flight.prefill.load -= 1
            if flight.sent > start:          # the prefill's first token went ahead
                dup += min(n, flight.sent - start)
            if start + n > flight.sent:
                flight.sent = start + n
        for rid in seen.ends:
            self._ended(server.inflight.pop(rid))
        if dup == seen.tokens and not seen.ends:
            return                           # nothing its client has not had
        client = flights[0].client
        server.tally.add(seen.tokens - dup, seen.ends)
        if not server.front.send_frames(client, list(body)) and server.front.last_send_unreachable:
            server.client_gone(client)

    def _check(self, sender: Worker, seen: Peek) -> list[InFlight] | None:
        """The body's flights if it may pass unread, else None."""
        server = self.server
        if not seen.rids or (server.adoption is not None and server.adoption.unclaimed):
            return None
        inflight = server.inflight
        try:
            flights = [inflight.get(rid) for rid in seen.rids]
        except TypeError:                    # a rid that is not a string (unhashable)
            return None
        first = flights[0]
        if first is None:
            return None
        client = first.client
        for flight in flights:
            if flight is None or flight.decode is not sender or flight.client != client:
                return None
        return flights

    def parts(self, parts: list[TokenPart], sender: Worker | None = None) -> None:
        """Tokens settled part by part (a decoded body; the router's own answers when
        `sender` is None): one message on to each client concerned."""
        server = self.server
        by_client: dict[bytes, list[TokenPart]] = {}
        for got in parts:
            flight, part = self._settle(got, sender)
            held = part is not None and server.adoption is not None and server.adoption.hold(part)
            if part is not None and not held:           # held: its client is away
                by_client.setdefault(flight.client, []).append(part)
        for client, mine in by_client.items():
            server.to_client(client, Tokens.pack(mine))
        server.dispatch()                    # finished requests made room

    def _settle(self, part: TokenPart, sender: Worker | None) -> tuple[InFlight | None, TokenPart | None]:
        """The request's flight and what of the decode's `part` the client has not had
        (None: nothing); the flight is forgotten once it finishes. Only the worker that
        answers the request may: its decode, or the prefill of a scoring one."""
        flight = self.server.inflight.get(part.rid)
        if flight is None:
            return None, None
        answers = flight.decode or flight.prefill
        if sender is not None and sender is not answers:
            log.warning("dropping tokens for rid=%r from %s %s: %s %s answers it", part.rid,
                        sender.role, sender.endpoint, answers.role, answers.endpoint)
            return None, None
        start, n = flight.from_decode, len(part.token_ids)
        flight.from_decode += n
        if n and not flight.prefilled:           # the decode has the KV: prefill's part is done
            flight.prefilled = True
            flight.prefill.load -= 1
        skip = min(n, max(0, flight.sent - start))    # the prefill's first token went ahead
        flight.sent = max(flight.sent, start + n)
        if skip:
            part = part.skip(skip)
        if part.finished:
            del self.server.inflight[part.rid]
            self._ended(flight)
        return flight, (part if part.token_ids or part.finished else None)

    def _ended(self, flight: InFlight) -> None:
        server = self.server
        server.shares.release(flight.rid)
        if not flight.prefilled:
            flight.prefill.load -= 1
        if flight.decode is not None:
            flight.decode.load -= 1

    def _slow(self, sender: Worker, body: Sequence[Any]) -> None:
        self.slow += 1
        try:
            msg = decode([bytes(f.buffer) if hasattr(f, "buffer") else f for f in body])
        except ProtocolError as e:
            self._malformed(sender, e)
            return
        if isinstance(msg, Tokens) and not msg.first:
            self.parts(msg.unpack(), sender)

    def rows(self, msg: Rows, sender: Worker) -> None:
        """A finished request's routed experts, ahead of its final tokens: on to its
        client, only from the worker that answers it, once, and only if it asked (else
        dropped: the final part then finds them missing, and its client fails it)."""
        flight = self.server.inflight.get(msg.rid)
        answers = None if flight is None else flight.decode or flight.prefill
        if flight is None or sender is not answers or not flight.routed or flight.rows:
            log.warning("dropping rows for rid=%r from %s %s: %s", msg.rid, sender.role,
                        sender.endpoint, "no such request" if flight is None else
                        f"{answers.role} {answers.endpoint} answers it" if sender is not answers
                        else "passed already" if flight.rows else "it asked none")
            return
        flight.rows = True
        if self.server.adoption is None or not self.server.adoption.hold_rows(msg):
            self.server.to_client(flight.client, msg)

    @staticmethod
    def _malformed(sender: Worker, e: ProtocolError) -> None:
        sender.dealer.bad_messages += 1
        log.warning("dropped a malformed step from %s %s: %s", sender.role, sender.endpoint,
                    e.reason)
