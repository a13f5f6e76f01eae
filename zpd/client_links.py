"""zpd.Client's sockets: one DEALER per router of its list, each with a socket monitor
(a killed router shows as its connection dropping), polled together."""
from __future__ import annotations

import time

import zmq

from zpd.failover import LINK_EVENTS, monitor_event
from zpd.wire.net import Curve, Dealer, SocketOptions
from zpd.wire.protocol import Message


class Links:
    """The routers' connections, by index into the client's router list; `heard[i]` is
    when router i last spoke (time.monotonic)."""

    def __init__(self, ctx: zmq.Context, endpoints: tuple[str, ...], curve: Curve | None) -> None:
        self.dealers: list[Dealer] = []
        self.monitors: list[zmq.Socket] = []
        try:
            for e in endpoints:
                self.dealers.append(Dealer(ctx, e, opts=SocketOptions(curve=curve)))
                self.monitors.append(self.dealers[-1].socket.get_monitor_socket(LINK_EVENTS))
        except BaseException:
            self.close()
            raise
        self.poller = zmq.Poller()
        for sock in [d.socket for d in self.dealers] + self.monitors:
            self.poller.register(sock, zmq.POLLIN)
        self.heard = [time.monotonic()] * len(self.dealers)

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
