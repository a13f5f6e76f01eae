"""One asyncio DEALER to one router, with its socket monitor: the HTTP front's router
client (zpd/http/router_client.py) keeps one per router of its --router list."""
from __future__ import annotations

import logging

import zmq
import zmq.asyncio

from zpd.failover import LINK_EVENTS, monitor_event
from zpd.wire.net import Curve, SocketOptions, configure_socket, parse_endpoint
from zpd.wire.protocol import Generate, Message, encode
from zpd.wire.resume import Resumes, client_identity

log = logging.getLogger("zpd.http.router_link")


class Link:
    """A connection to one router; `heard` is when it last spoke (loop time), `resumes`
    its open requests, resumed if it restarts (zpd/wire/resume.py)."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, curve: Curve | None,
                 now: float) -> None:
        host, port = parse_endpoint(endpoint)
        self.endpoint, self.heard, self.resumes = endpoint, now, Resumes(now)
        self.sock = ctx.socket(zmq.DEALER)
        configure_socket(self.sock, host=host, server=False, opts=SocketOptions(curve=curve))
        self.sock.setsockopt(zmq.IDENTITY, client_identity())   # see zpd/wire/resume.py
        # A dropped connection is how a killed router shows at once (its pings stop
        # only while requests run, and a request waits out the connect timeout).
        self.monitor = self.sock.get_monitor_socket(LINK_EVENTS)
        bracketed = f"[{host}]" if ":" in host else host
        self.sock.connect(f"tcp://{bracketed}:{port}")

    def send(self, msg: Message, frames: list[bytes] | None = None) -> bool:
        """Queue `msg` (as `frames`, if encoded already) without waiting; False when the
        socket's queue is full."""
        done = self.sock.send_multipart(frames or encode(msg), flags=zmq.DONTWAIT)
        if done.exception() is not None:
            log.warning("dropped %s to the router %s: %s", msg.TYPE, self.endpoint,
                        done.exception())
            return False
        return True

    async def recv(self) -> list[bytes]:
        return await self.sock.recv_multipart()

    async def event(self) -> int:
        """The next event of the connection (zmq.EVENT_CONNECTED or _DISCONNECTED)."""
        return monitor_event(await self.monitor.recv_multipart())

    def close(self, linger: int = 0) -> None:
        self.sock.disable_monitor()
        self.monitor.close(linger=0)
        self.sock.close(linger=linger)


class Unacked:
    """A request sent and not yet acknowledged: enough to send it to another router."""

    def __init__(self, msg: Generate, frames: list[bytes]) -> None:
        self.msg, self.frames = msg, frames
        self.tried: set[int] = set()
