"""Decode's connections to prefill workers: one DEALER each, with the hello handshake."""
from __future__ import annotations

import enum
import logging
import os
from dataclasses import dataclass, field
from typing import Callable

import zmq

from zpd.wire.drops import DropPlan
from zpd.wire.liveness import PeerClock
from zpd.wire.loop import Loop
from zpd.wire.net import INPROC, Dealer, SocketOptions, parse_endpoint
from zpd.wire.protocol import Hello, HelloAck, Message, Ping, Pong

log = logging.getLogger("zpd.worker.links")

_HOST_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.-_:%")


def well_formed(endpoint: object) -> bool:
    """`endpoint` is one a decode may dial: host:port (a port in [1, 65535], a host
    of name or address characters) or an in-process name (tests). Checked before
    any socket is made, since a socket for a bad one raises in the scheduler."""
    if not isinstance(endpoint, str) or len(endpoint) > 300:
        return False
    if endpoint.startswith(INPROC):
        return len(endpoint) > len(INPROC)
    try:
        host, port = parse_endpoint(endpoint)
    except ValueError:
        return False
    return 0 < port < 65536 and set(host) <= _HOST_CHARS


class LinkState(enum.Enum):
    CONNECTING = "connecting"      # hello sent, no answer yet
    READY = "ready"
    REFUSED = "refused"            # incompatible: every request for it fails
    DEAD = "dead"                  # no heartbeat answer: requests fail with 503 until it answers


@dataclass(eq=False)
class PrefillLink:
    """One prefill as this decode sees it: its DEALER, handshake state and liveness."""
    endpoint: str
    dealer: Dealer
    clock: PeerClock
    drops: DropPlan
    state: LinkState = LinkState.CONNECTING
    reason: str = ""
    session: str = ""              # the prefill's transport session, from its last hello_ack
    waiting: list[Callable[[], None]] = field(default_factory=list)   # run once READY

    def when_ready(self, action: Callable[[], None]) -> None:
        if self.state is LinkState.READY:
            action()
        else:
            self.waiting.append(action)

    def send(self, msg: Message) -> None:
        if not self.drops.drops(msg):
            self.dealer.send(msg)


class PrefillLinks:
    """Creates links on first use and routes their inbound messages to `on_message`."""

    def __init__(self, ctx: zmq.Context, loop: Loop, hello: Hello,
                 on_message: Callable[[PrefillLink, Message], None],
                 on_refused: Callable[[PrefillLink], None],
                 on_restarted: Callable[[PrefillLink], None],
                 opts: SocketOptions = SocketOptions(), heartbeat: float = 0.5,
                 peer_timeout: float = 2.0, drops: DropPlan | None = None) -> None:
        self.ctx, self.loop, self.hello, self.opts = ctx, loop, hello, opts
        self.on_message, self.on_refused, self.on_restarted = on_message, on_refused, on_restarted
        self.peer_timeout = peer_timeout
        self.drops = drops or DropPlan()
        # The pid makes a restarted decode a new peer to the prefill, so a write meant
        # for the old process can never go to the new one's pages; the nonce makes the
        # identity one nobody else can name, so nobody claims it once we are gone.
        self.identity = f"decode@{hello.decode}/{os.getpid()}.{os.urandom(8).hex()}".encode()
        self.links: dict[str, PrefillLink] = {}
        self.pings = 0
        loop.every(heartbeat, self.heartbeat)

    def heartbeat(self) -> None:
        """Ping every prefill; one silent past the timeout is dead (the refused stay refused)."""
        now = self.loop.time()
        self.pings += 1
        for link in self.links.values():
            if link.state in (LinkState.READY, LinkState.CONNECTING) and \
                    link.clock.silent(now, self.peer_timeout):
                link.state, link.reason = LinkState.DEAD, f"prefill {link.endpoint} is unavailable"
                log.error("prefill %s silent for %.1f s: marked dead", link.endpoint,
                          link.clock.silence(now))
                link.waiting.clear()
                self.on_refused(link)
            link.send(Ping(self.pings, now, self.hello.decode))
            link.clock.pinged(now)

    def get(self, endpoint: str) -> PrefillLink:
        link = self.links.get(endpoint)
        if link is None:
            dealer = Dealer(self.ctx, endpoint, identity=self.identity, opts=self.opts)
            link = self.links[endpoint] = PrefillLink(endpoint, dealer, PeerClock(self.loop.time()),
                                                      self.drops)
            self.loop.add_socket(dealer, lambda: self._on_readable(link))
            link.send(self.hello)
        return link

    def rehello(self, hello: Hello) -> None:
        """Our pool moved (resume_memory): every prefill must learn the new address
        before it is sent another kv_dest, so READY links handshake again."""
        self.hello = hello
        for link in self.links.values():
            if link.state is LinkState.READY:
                link.state = LinkState.CONNECTING
            link.send(hello)

    def _on_readable(self, link: PrefillLink) -> None:
        msg = link.dealer.recv()
        if msg is None:
            return
        link.clock.heard(self.loop.time())
        if link.state is LinkState.DEAD:
            # back (maybe a new process on the same port): handshake again before use
            link.state, link.reason = LinkState.CONNECTING, ""
            log.warning("prefill %s answers again; saying hello", link.endpoint)
            link.send(self.hello)
        if isinstance(msg, Pong):
            return
        if isinstance(msg, HelloAck):
            self._on_hello_ack(link, msg)
        else:
            self.on_message(link, msg)

    def _on_hello_ack(self, link: PrefillLink, msg: HelloAck) -> None:
        if not msg.ok:
            link.state, link.reason = LinkState.REFUSED, msg.reason
            log.error("prefill %s refused us: %s", link.endpoint, msg.reason)
            link.waiting.clear()
            self.on_refused(link)
            return
        restarted = link.session not in ("", msg.session_id)
        link.state, link.session = LinkState.READY, msg.session_id
        log.info("linked to prefill %s (session %s, weights %s)", link.endpoint, msg.session_id,
                 msg.weight_version)
        if restarted:
            self.on_restarted(link)
        waiting, link.waiting = link.waiting, []
        for action in waiting:
            action()

    def status(self) -> list[dict]:
        return [{"endpoint": l.endpoint, "state": l.state.value, "reason": l.reason}
                for l in self.links.values()]

    def close(self) -> None:
        for link in self.links.values():
            self.loop.remove_socket(link.dealer)
            link.dealer.close()
