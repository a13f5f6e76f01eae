"""A router restarted on its endpoint picks up its predecessor's requests.

At start the router asks every decode to `Adopt` the requests of the earlier
processes of its endpoint (zpd/worker/ha/adoption.py says which); each decode answers
`Adopted` with, per rid, its client, prefill, share and output so far, then the
tokens of each streamed one from the first, and the whole answer of each that ended
while no router listened. The router rebuilds their flights (client, loads, shares)
and keeps their tokens, for only the client knows how many it has: a client that
sees the router's boot id change sends `Resume(rid, have)` for each request it waits
for (zpd/wire/resume.py). The router then sends the tokens past `have` and streams
on. Everything else ends 503 at once: a rid it holds for another client (that
client learns nothing, the owner's request goes on), a rid it never adopted (queued
in the dead router, scored by a prefill, or ended in the moment before its decode
saw the router gone). A flight nobody claims within CLAIM_S is aborted with 503.
Resumes that come while a decode has not answered yet wait for it, at most the peer
timeout; what a decode hands over later than that is aborted there.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Collection, Protocol

from zpd.config import RouterConfig
from zpd.router.flights import InFlight, Worker
from zpd.router.shares import ClientShares
from zpd.wire.admin_fields import PauseMode
from zpd.wire.loop import Loop, Timer
from zpd.wire.payloads import AdoptedRequest
from zpd.wire.protocol import Abort, Adopt, Adopted, Message, Resume, Rows, TokenPart, Tokens

log = logging.getLogger("zpd.router.ha.adoption")

CLAIM_S = 30.0          # an adopted request's client resumes within this, or it is aborted
LOST = "router restarted; request lost"
PAUSE_MODES = {m.value for m in PauseMode}


class Adopter(Protocol):
    """What the adoption reads and changes of its router (RouterServer is one)."""
    cfg: RouterConfig
    loop: Loop
    workers: list[Worker]
    inflight: dict[str, InFlight]
    shares: ClientShares
    paused: PauseMode | None

    @property
    def queued(self) -> Collection[str]: ...

    def owner(self, rid: str) -> bytes | None: ...

    def to_client(self, client: bytes, msg: Message) -> None: ...

    def on_abort(self, msg: Abort) -> None: ...


@dataclass(eq=False)
class Unclaimed:
    """An adopted request whose client has not resumed it yet."""
    client: bytes
    timer: Timer
    backlog: TokenPart | None = None     # its tokens from the first, and its end if it came
    rows: Rows | None = None             # its routed experts, ahead of that end


class Adoption:
    """The restart's state on one router: the decodes not answered yet, the adopted
    requests not claimed yet and the resumes waiting for the decodes."""

    def __init__(self, server: Adopter) -> None:
        self.server = server
        self.asking = {w.endpoint for w in server.workers if w.role == "decode"}
        self.unclaimed: dict[str, Unclaimed] = {}
        self.waiting: list[tuple[bytes, Resume]] = []
        for w in server.workers:
            if w.role == "decode":
                w.dealer.send(Adopt())
        self.timer = server.loop.call_later(server.cfg.peer_timeout, self._asked)

    def on_adopted(self, worker: Worker, msg: Adopted) -> None:
        if worker.role != "decode":
            log.warning("dropping adopted from %s %s", worker.role, worker.endpoint)
            return
        if msg.paused in PAUSE_MODES and self.server.paused is None:
            self.server.paused = PauseMode(msg.paused)     # paused before this router began
        late = worker.endpoint not in self.asking     # its clients' resumes had 503 already
        for rid, reason in msg.refused.items():
            self._refuse(worker, rid, f"unusable ({reason:.200})")
        for rid, entry in msg.requests.items():
            flight = None if late else self._flight(worker, rid, entry)
            if flight is None:
                self._refuse(worker, rid, "too late" if late else f"unusable ({entry!r:.200})")
                continue
            self._adopt(flight, entry)
        if msg.requests or msg.refused:
            log.warning("decode %s handed over %d requests", worker.endpoint,
                        len(msg.requests) + len(msg.refused))
        self.asking.discard(worker.endpoint)
        if not self.asking:
            self._asked()

    @staticmethod
    def _refuse(decode: Worker, rid: str, why: str) -> None:
        """End a handed-over request at its decode: this router does not take it."""
        log.warning("decode %s handed over rid=%r %s: aborting it", decode.endpoint, rid, why)
        decode.dealer.send(Abort(rid, 503, LOST))

    def _flight(self, decode: Worker, rid: str, entry: AdoptedRequest) -> InFlight | None:
        """The flight an Adopted entry describes (None: a rid or prefill this router
        does not take; the entry itself was checked by the wire decode)."""
        server = self.server
        prefills = {w.endpoint: w for w in server.workers if w.role == "prefill"}
        if rid in server.inflight or rid in server.queued or entry.prefill not in prefills:
            return None
        return InFlight(rid, entry.client, prefills[entry.prefill], decode, prefilled=entry.output > 0,
                        routed=entry.routed)

    def _adopt(self, flight: InFlight, entry: AdoptedRequest) -> None:
        server, rid = self.server, flight.rid
        server.inflight[rid] = flight
        server.shares.take(flight.client, rid, entry.tokens)
        flight.decode.load += 1
        if not flight.prefilled:
            flight.prefill.load += 1
        self.unclaimed[rid] = Unclaimed(flight.client, server.loop.call_later(CLAIM_S, self._expire, rid))

    def hold(self, part: TokenPart) -> bool:
        """Keep `part` for a client that has not resumed yet (False: not such a request)."""
        entry = self.unclaimed.get(part.rid)
        if entry is None:
            return False
        entry.backlog = part if entry.backlog is None else entry.backlog.then(part)
        return True

    def hold_rows(self, msg: Rows) -> bool:
        """Keep `msg` for a client that has not resumed yet (False: not such a request)."""
        entry = self.unclaimed.get(msg.rid)
        if entry is not None:
            entry.rows = msg
        return entry is not None

    def on_resume(self, client: bytes, msg: Resume) -> None:
        if self.asking:
            self.waiting.append((client, msg))
            return
        entry = self.unclaimed.get(msg.rid)
        if entry is not None and entry.client == client:
            self._claim(msg.rid, msg.have)
        elif entry is not None or self.server.owner(msg.rid) != client:
            self.server.to_client(client, Tokens.abort(msg.rid, 503, LOST))
        # else: a request this router runs for this client: its tokens flow already

    def _claim(self, rid: str, have: int) -> None:
        entry = self.unclaimed.pop(rid)
        entry.timer.cancel()
        flight = self.server.inflight.get(rid)
        if flight is not None:                 # tokens past `have` only, from now on too
            flight.sent = max(flight.sent, have)
        part = entry.backlog
        if part is not None:
            part = part.skip(min(have, len(part.token_ids)))
        if entry.rows is not None:
            self.server.to_client(entry.client, entry.rows)
        if part is not None and (part.token_ids or part.finished):
            self.server.to_client(entry.client, Tokens.pack([part]))
        log.info("rid=%r resumed by its client from token %d", rid, have)

    def _expire(self, rid: str) -> None:
        entry = self.unclaimed.pop(rid, None)
        if entry is not None and rid in self.server.inflight:
            log.warning("rid=%r adopted but not resumed within %g s: aborting it", rid, CLAIM_S)
            self.server.on_abort(Abort(rid, 503, f"{LOST}: its client did not resume it"))

    def _asked(self) -> None:
        """Every decode answered, or the time to wait for them is over."""
        self.timer.cancel()
        self.asking.clear()
        waiting, self.waiting = self.waiting, []
        for client, msg in waiting:
            self.on_resume(client, msg)
