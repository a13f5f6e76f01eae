"""A second process that plays a router in the gap between its death and its restart
(issue 43): it connects to each decode given under the names a client can make up for
the dead router (`router@ENDPOINT/BOOT` with its real boot id, and with a made-up one),
asks each to adopt, and prints what reached it as JSON: Adopted entries and token
messages. Run: python -m tests.e2e.forged_router ROUTER_EP BOOT DECODE_EP [DECODE_EP...]"""
from __future__ import annotations

import sys
import time

import orjson
import zmq

from zpd.wire.net import Dealer
from zpd.wire.protocol import Adopt, Adopted, Ping, Tokens

LISTEN_S = 1.5


def main(router: str, boot: str, decodes: list[str]) -> dict:
    ctx = zmq.Context()
    got = {"adopted": 0, "tokens": 0}
    try:
        thieves = [Dealer(ctx, ep, identity=f"router@{router}/{b}".encode())
                   for ep in decodes for b in (boot, "1.forged")]
        for thief in thieves:
            thief.send(Ping(1, time.time(), router, boot))
            thief.send(Adopt())
        until = time.monotonic() + LISTEN_S
        while time.monotonic() < until:
            for thief in thieves:
                msg = thief.recv(timeout=0.01)
                if isinstance(msg, Adopted):
                    got["adopted"] += len(msg.requests)
                elif isinstance(msg, Tokens):
                    got["tokens"] += 1
    finally:
        ctx.destroy(linger=0)
    return got


if __name__ == "__main__":
    print(orjson.dumps(main(sys.argv[1], sys.argv[2], sys.argv[3:])).decode())
