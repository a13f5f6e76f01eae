"""A client that stops reading its stream: the front holds a bounded amount of it
unsent, and past the write timeout aborts its requests at the router and closes the
connection (issue 30, item 7). A real TCP connection to the aiohttp app, with small
socket buffers on both sides so that the kernel holds little, and a fake router
that keeps generating."""
from __future__ import annotations

import asyncio
import logging
import socket

from aiohttp import web

from tests.unit.http_fake import FakeBackend, front, tiny_answer
from zpd.config import HttpConfig
from zpd.http.guard.plug import guarded_app

BUFFER = 16 << 10
TIMEOUT = 0.5
BODY = (b'{"input_ids": [1], "stream": true, "rid": "slow", '
        b'"sampling_params": {"max_new_tokens": 100000}}')


def request(path: str, body: bytes) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


def small_socket(listening: bool) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    option = socket.SO_SNDBUF if listening else socket.SO_RCVBUF
    sock.setsockopt(socket.SOL_SOCKET, option, 4096)   # accepted sockets inherit it
    sock.setblocking(False)
    return sock


async def never_read(backend: FakeBackend, path: str, body: bytes) -> tuple[int, bool]:
    """Serve the app, send one streamed request from a client that never reads, and
    wait (bounded) until the front closes the request at the router. Returns the most
    bytes the front held unsent for that connection, and whether it closed it."""
    f = front(backend, config=HttpConfig(stream_write_timeout=TIMEOUT,
                                         stream_buffer_bytes=BUFFER))
    runner = web.AppRunner(guarded_app(f), handler_cancellation=True, access_log=None)
    await runner.setup()
    listener = small_socket(True)
    listener.bind(("127.0.0.1", 0))
    site = web.SockSite(runner, listener)
    await site.start()
    client = small_socket(False)
    loop = asyncio.get_running_loop()
    try:
        await loop.sock_connect(client, listener.getsockname())
        await loop.sock_sendall(client, request(path, body))
        peak = 0
        for _ in range(400):                               # 20 s at most
            for conn in runner.server.connections:
                if conn.transport is not None:
                    peak = max(peak, conn.transport.get_write_buffer_size())
            if backend.closed:
                break
            await asyncio.sleep(0.05)
        for _ in range(100):
            if not runner.server.connections:
                break
            await asyncio.sleep(0.02)
        return peak, not runner.server.connections
    finally:
        client.close()
        await runner.cleanup()


def endless(req, rid):
    """Tokens without end (until the front closes the request): 100 per chunk."""
    return tiny_answer(req, rid, [72, 105, 33, 32] * 25 * 400, per_chunk=100)[:-1]


def test_a_client_that_stops_reading_is_aborted_and_its_buffer_stays_bounded(caplog):
    completion = b'{"prompt": [1], "stream": true, "max_tokens": 100000}'
    for path, body, rid in (("/generate", BODY, "slow"), ("/v1/completions", completion, "r0")):
        backend = FakeBackend(endless, block_after=300)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="zpd.http.streams"):
            peak, closed = asyncio.run(never_read(backend, path, body))
        # aborted at the router, so the workers free its pages (the front may prefix the
        # rid with its caller's name)
        assert len(backend.closed) == 1 and backend.closed[0].endswith(rid), (path, backend.closed)
        assert closed, path                               # and the connection dropped
        # the transport's bound, plus aiohttp's 64 KiB between drains, plus one event
        assert peak <= BUFFER + (64 << 10) + (64 << 10), (path, peak)
        lines = [r.getMessage() for r in caplog.records if "read nothing" in r.getMessage()]
        assert len(lines) == 1 and "1 request(s) aborted" in lines[0], lines
