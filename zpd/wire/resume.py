"""What a client of the router keeps so that its requests outlive a router restart.

A router restarted on its endpoint adopts the requests its predecessor had running
on the decodes (zpd/router/ha/adoption.py), but only the client knows how many tokens
of each it has. Every Accepted, Ping and Pong of a router carries its boot id; when a
request's router boot changes, the client sends `Resume(rid, have)` and the router
sends the tokens past `have`, then the rest, or ends the request with 503 where it
was lost. A router pings the clients with requests in flight; one it does not know
(none of its requests was adopted) hears nothing, so a client that has heard nothing
for PROBE_S while it waits pings the router itself, and its pong carries the boot.

The router gives a request back only to the identity that sent it (its ROUTER does no
handover), so a client keeps one random identity for its lifetime (`client_identity`)
instead of the one ZeroMQ would pick per connection. zpd.Client and the HTTP front's
router connection both use `Resumes`.
"""
from __future__ import annotations

import uuid

from zpd.wire.protocol import Accepted, Message, Ping, Pong, Resume, TokenPart

PROBE_S = 1.0       # silent this long while requests are open: ping the router


def client_identity() -> bytes:
    """A fresh identity for one client connection: unguessable, printable, and not
    starting with a zero byte (ZeroMQ's own identities do)."""
    return f"client-{uuid.uuid4().hex}".encode()


class Resumes:
    """Per open request: the boot id of the router that accepted it and the tokens
    received; `note` each message from the router and send what it returns, `got`
    each request's part."""

    def __init__(self, now: float = 0.0) -> None:
        self.open: dict[str, list] = {}     # rid -> [boot (None until accepted), tokens]
        self.heard = now                    # when the router last spoke
        self.boot = ""                      # the router's boot id, as last seen

    def opened(self, rid: str, now: float) -> None:
        self.open[rid] = [None, 0]
        self.heard = max(self.heard, now)   # silence counts from here

    def closed(self, rid: str) -> None:
        self.open.pop(rid, None)

    def note(self, msg: Message, now: float) -> list[Resume]:
        """The router spoke: the resumes to send if its boot id changed (`got` counts
        the tokens of a Tokens message)."""
        self.heard = now
        if not isinstance(msg, (Accepted, Ping, Pong)):
            return []
        if isinstance(msg, Accepted):
            for rid in msg.rids:
                if rid in self.open and self.open[rid][0] is None:
                    self.open[rid][0] = msg.boot
        if not msg.boot or msg.boot == self.boot:       # the usual case: nothing to look at
            return []
        self.boot = msg.boot
        return self.rebooted(msg.boot)

    def got(self, part: TokenPart) -> TokenPart | None:
        """`part` less the tokens of it this client has already (a part says where it
        starts: a decode sends again the first token its prefill sent ahead, and after a
        resume what came before `have`); None when nothing of it is new."""
        entry = self.open.get(part.rid)
        if entry is not None:
            if part.start is not None and part.start < entry[1]:
                part = part.skip(min(entry[1] - part.start, len(part.token_ids)))
            entry[1] += len(part.token_ids)
        if part.finished:
            self.open.pop(part.rid, None)
        return part if part.token_ids or part.finished else None

    def rebooted(self, boot: str) -> list[Resume]:
        """Resumes for the requests accepted by a router other than boot `boot`'s."""
        resumes = []
        for rid, entry in self.open.items():
            if boot and entry[0] and entry[0] != boot:
                entry[0] = boot
                resumes.append(Resume(rid, entry[1]))
        return resumes

    def probe(self, now: float) -> Ping | None:
        """A ping for the router when requests are open and it has been silent PROBE_S."""
        if not self.open or now - self.heard < PROBE_S:
            return None
        self.heard = now
        return Ping(0, now)

    def wait(self, now: float) -> float:
        """Seconds until `probe` may have something to send."""
        return max(0.0, self.heard + PROBE_S - now) if self.open else float("inf")
