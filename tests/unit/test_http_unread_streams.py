"""Thirty clients that open a stream and never read it (issue 43, audit 2's held-out
check: they grew the front by 54 MB and were still held 60 s later). Real TCP
connections with the kernel's default buffers to the aiohttp app, and a fake router
that generates without end: the front holds a bounded number of their bytes, all
streams together included, and aborts their requests within a bounded time."""
from __future__ import annotations

import asyncio
import socket
import time

from aiohttp import web

from tests.unit.http_fake import FakeBackend, chunk, front
from zpd.config import HttpConfig
from zpd.http.guard.plug import guarded_app

CLIENTS = 30
TIMEOUT = 1.0                       # --stream-write-timeout, short for the test
TOTAL = 1 << 20                     # --stream-buffer-total-bytes
BURST = 150
BODY = (b'{"input_ids": [1], "stream": true, '
        b'"sampling_params": {"max_new_tokens": 100000}}')


def endless(req, rid):
    """100 tokens a chunk, until the front closes the request (the fake stops after
    BURST chunks: /generate's cumulative events then carry 15,000 tokens each, and a
    stream has written more than the kernel and the front's buffer hold together)."""
    while True:
        yield chunk(rid, [72, 105, 33, 32] * 25)


def request(body: bytes) -> bytes:
    return (f"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body


async def unread(backend: FakeBackend, config: HttpConfig) -> dict:
    """Serve the app, open CLIENTS streams that are never read, and watch (bounded)
    until the front has aborted all their requests and closed their connections."""
    runner = web.AppRunner(guarded_app(front(backend, config=config)), handler_cancellation=True,
                           access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    address = site._server.sockets[0].getsockname()
    loop = asyncio.get_running_loop()
    clients, peak, sndbuf = [], 0, {}
    started = time.monotonic()
    try:
        for _ in range(CLIENTS):
            sock = socket.socket()
            sock.setblocking(False)
            await loop.sock_connect(sock, address)
            await loop.sock_sendall(sock, request(BODY))
            clients.append(sock)
        for _ in range(600):                                # 30 s at most
            conns = [c.transport for c in runner.server.connections if c.transport is not None]
            peak = max(peak, sum(t.get_write_buffer_size() for t in conns))
            for t in conns:             # each one's kernel buffer as its stream set it
                if t.get_write_buffer_size():
                    sock = t.get_extra_info("socket")
                    sndbuf[t] = sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
            if len(backend.closed) == CLIENTS and not runner.server.connections:
                break
            await asyncio.sleep(0.05)
        return {"seconds": time.monotonic() - started, "peak": peak, "sndbuf": max(sndbuf.values(), default=0),
                "closed": len(backend.closed), "open": len(runner.server.connections)}
    finally:
        for sock in clients:
            sock.close()
        await runner.cleanup()


def test_thirty_unread_streams_are_aborted_soon_and_hold_a_bounded_total():
    config = HttpConfig(stream_write_timeout=TIMEOUT, stream_buffer_total_bytes=TOTAL)
    got = asyncio.run(unread(FakeBackend(endless, block_after=BURST), config))
    # every request aborted at the router (the workers free its pages), every connection dropped
    assert got["closed"] == CLIENTS and got["open"] == 0, got
    # found out after the kernel holds a stream's buffer (not the megabytes Linux
    # lets a loopback socket grow to), then the write timeout
    assert got["seconds"] < 8 * TIMEOUT, got
    assert got["sndbuf"] <= 2 * config.stream_buffer_bytes, got     # Linux doubles what is set
    # all streams together: the total budget plus what each had in hand when it was
    # passed (aiohttp drains every 64 KiB, then one event)
    assert got["peak"] <= TOTAL + CLIENTS * (64 << 10), got
