"""zpd.Client's sockets: one DEALER per router of its list, each with a socket monitor
(a killed router shows as its connection dropping), polled together."""
from __future__ import annotations

import time

import zmq

from zpd.failover import LINK_EVENTS, monitor_event
from zpd.wire.net import Curve, Dealer, SocketOptions
from zpd.wire.protocol import Message
from zpd.wire.resume import Resumes, client_identity


class Links:
    """The routers' connections, by index into the client's router list; `heard[i]` is
    when router i last spoke (time.monotonic), `resumes[i]` its open requests, resumed
    if it restarts (zpd/wire/resume.py)."""

    def __init__(self, ctx: zmq.Context, endpoints: tuple[str, ...], curve: Curve | None) -> None:
        self.dealers: list[Dealer] = []
        self.monitors: list[zmq.Socket] = []
        try:
            for e in endpoints:
                # one identity for good: a restarted router gives requests back only to it
                self.dealers.append(Dealer(ctx, e, identity=client_identity(),
                                           opts=SocketOptions(curve=curve)))
                self.monitors.append(self.dealers[-1].socket.get_monitor_socket(LINK_EVENTS))
        except BaseException:
            self.close()
            raise
        self.poller = zmq.Poller()
        for sock in [d.socket for d in self.dealers] + self.monitors:
            self.poller.register(sock, zmq.POLLIN)
        self.heard = [time.monotonic()] * len(self.dealers)
        self.resumes = [Resumes(time.monotonic()) for _ in self.dealers]

    def probe(self, now: float) -> None:
        """Requests open and a router silent: ping it (a restarted one answers with its
        boot id, and the requests are resumed)."""
        for i, resumes in enumerate(self.resumes):
            ping = resumes.probe(now)
            if ping is not None:
                self.send(i, ping)

    def probe_wait(self, now: float) -> float:
        return min(r.wait(now) for r in self.resumes)

    def endpoint(self, i: int) -> str:
        return self.dealers[i].endpoint

    def send(self, i: int, msg: Message) -> bool:
        return self.dealers[i].send(msg)

    def poll(self, timeout: float) -> tuple[tuple[int, Message] | None, list[tuple[int, int]]]:
        """Within `timeout` seconds: the next message and its router, else the connection
        events that came, as (router, event). Messages first: what a router said before
        its connection dropped (an acknowledgement) counts."""
        ready = dict(self.poller.poll(int(timeout * 1000) or 1))
        for i, dealer in enumerate(self.dealers):
            if dealer.socket in ready:
                msg = dealer.recv()
                if msg is not None:
                    self.heard[i] = time.monotonic()
                    return (i, msg), []
        return None, [(i, monitor_event(m.recv_multipart()))
                      for i, m in enumerate(self.monitors) if m in ready]

    def close(self) -> None:
        """Close every socket without lingering on unsent messages."""
        for dealer in self.dealers:
            dealer.socket.disable_monitor()
            dealer.close()
        for monitor in self.monitors:
            monitor.close(linger=0)
