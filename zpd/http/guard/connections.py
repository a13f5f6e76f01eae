"""Connections the front keeps open, and for how long.

aiohttp closes an idle connection only after an hour and never times out a request's
headers: 1,100 sockets that each sent half a request held the front's descriptors
(limit 1,024) and every real request timed out. Here each connection is watched:

- idle between requests longer than --keepalive-timeout: closed;
- started a request (sent a byte) but not all of its headers within --header-timeout:
  closed (a body is bounded by --body-timeout where the route reads it, body.py);
- past --max-connections open at once, the connection idle longest is closed to make
  room, or the new one refused when none is idle (a warning says so, at most every
  10 s). The default stays below the process's descriptor limit.

A connection counts as busy from its request's first middleware to its answer's end
(`tracking`), and the watch never closes a busy one: a long stream is not idle."""
from __future__ import annotations

import asyncio
import logging
import resource
import sys
from dataclasses import dataclass

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

log = logging.getLogger("zpd.http.guard.connections")

WARN_EVERY_S = 10.0


@dataclass(frozen=True)
class ConnectionLimits:
    keepalive: float = 75.0          # --keepalive-timeout
    header: float = 10.0             # --header-timeout
    max_connections: int = 0         # --max-connections; 0: from the descriptor limit


def connection_cap(wanted: int) -> int:
    """`wanted`, else three quarters of the soft descriptor limit (the rest: the
    router's socket, the tokenizer's files, logs, and room to accept and close)."""
    if wanted > 0:
        return wanted
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max(16, soft - max(64, soft // 4)) if soft != resource.RLIM_INFINITY else 1 << 16


class Conn:
    """One connection's clocks."""

    def __init__(self, transport: asyncio.Transport, now: float) -> None:
        self.transport = transport
        self.busy = 0
        self.idle_since = now                # since connect or the last answer
        self.started: float | None = None    # when a request's first byte came while idle


class Connections:
    """Every open connection of one server, and the sweep that closes the stale ones."""

    def __init__(self, limits: ConnectionLimits = ConnectionLimits()) -> None:
        self.limits, self.cap = limits, connection_cap(limits.max_connections)
        self.open: dict[asyncio.BaseTransport, Conn] = {}
        self.closed = {"idle": 0, "slow headers": 0, "over the cap": 0, "refused": 0}
        self._warned = 0.0
        self._task: asyncio.Task | None = None

    def admit(self, transport: asyncio.Transport) -> bool:
        now = _now()
        if len(self.open) >= self.cap:
            idle = [c for c in self.open.values() if not c.busy]
            if not idle:
                self._count("refused", now)
                return False
            self._close(min(idle, key=lambda c: c.started or c.idle_since), "over the cap", now)
        self.open[transport] = Conn(transport, now)
        return True

    def heard(self, transport: asyncio.BaseTransport) -> None:
        conn = self.open.get(transport)
        if conn is not None and not conn.busy and conn.started is None:
            conn.started = _now()

    def lost(self, transport: asyncio.BaseTransport) -> None:
        self.open.pop(transport, None)

    def begin(self, transport: asyncio.BaseTransport | None) -> None:
        conn = self.open.get(transport)
        if conn is not None:
            conn.busy += 1
            conn.started = None

    def end(self, transport: asyncio.BaseTransport | None) -> None:
        conn = self.open.get(transport)
        if conn is not None:
            conn.busy -= 1
            conn.idle_since, conn.started = _now(), None

    def sweep(self) -> None:
        now = _now()
        for conn in list(self.open.values()):
            if conn.busy:
                continue
            if conn.started is not None and now - conn.started > self.limits.header:
                self._close(conn, "slow headers", now)
            elif now - conn.idle_since > self.limits.keepalive:
                self._close(conn, "idle", now)

    def _close(self, conn: Conn, why: str, now: float) -> None:
        self.open.pop(conn.transport, None)
        conn.transport.abort()
        self._count(why, now)

    def _count(self, why: str, now: float) -> None:
        self.closed[why] += 1
        if why in ("over the cap", "refused") and now - self._warned > WARN_EVERY_S:
            self._warned = now
            log.warning("%d connections open, the most --max-connections allows: closed %d "
                        "idle ones and refused %d new ones so far (closed for slow headers: "
                        "%d)", len(self.open), self.closed["over the cap"],
                        self.closed["refused"], self.closed["slow headers"])

    async def _sweeping(self) -> None:
        step = min(1.0, max(0.05, min(self.limits.header, self.limits.keepalive) / 4))
        while True:
            await asyncio.sleep(step)
            self.sweep()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._sweeping())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None


def _now() -> float:
    return asyncio.get_running_loop().time()


class Watched(asyncio.Protocol):
    """aiohttp's protocol for one connection, with the connection's clocks kept."""

    def __init__(self, book: Connections, make) -> None:
        self.book, self.make, self.inner = book, make, None
        self.transport: asyncio.BaseTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        if not self.book.admit(transport):
            transport.abort()
            return
        self.inner = self.make()
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self.inner is not None:
            self.book.heard(self.transport)
            self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received() if self.inner is not None else None

    def connection_lost(self, exc: Exception | None) -> None:
        self.book.lost(self.transport)
        if self.inner is not None:
            self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()


class WatchedSite(web.TCPSite):
    """aiohttp's TCP site, each connection Watched by `book`."""

    def __init__(self, runner: web.AppRunner, host: str, port: int, book: Connections,
                 reuse_port: bool = False) -> None:
        super().__init__(runner, host, port, reuse_port=reuse_port)
        self.book = book

    async def start(self) -> None:
        await web.BaseSite.start(self)          # registers the site with its runner
        server = self._runner.server
        self._server = await asyncio.get_running_loop().create_server(
            lambda: Watched(self.book, server), self._host, self._port,
            backlog=self._backlog, reuse_address=self._reuse_address,
            reuse_port=self._reuse_port)
        self.book.start()

    async def stop(self) -> None:
        await self.book.stop()
        await super().stop()


BOOK = web.AppKey("connections", Connections)


@web.middleware
async def tracking(request: web.Request, handler) -> web.StreamResponse:
    """Marks the request's connection busy while it is answered."""
    book, transport = request.app[BOOK], request.transport
    book.begin(transport)
    try:
        return await handler(request)
    finally:
        book.end(transport)


class ClientFaults(logging.LoggerAdapter):
    """aiohttp's server log, where a request aiohttp could not parse (a client's fault:
    bad headers, chunking, a body cut short) is one line, not a traceback."""

    def exception(self, msg, *args, exc_info=True, **kw) -> None:
        exc = exc_info if isinstance(exc_info, BaseException) else sys.exc_info()[1]
        if isinstance(exc, CLIENT_FAULTS):
            text = " ".join(str(exc).split())[:200]
            self.logger.info(msg + ": %s: %s", *args, type(exc).__name__, text)
        else:
            self.logger.error(msg, *args, exc_info=exc_info, **kw)


CLIENT_FAULTS = (HttpProcessingError, RequestPayloadError, ConnectionError)
SERVER_LOG = ClientFaults(logging.getLogger("zpd.http.server"), {})


def server_options(limits: ConnectionLimits) -> dict:
    """aiohttp's server settings for the front: bodies inflated by the routes after the
    key check (body.py), a client that disconnects cancels its handler (whose streams
    then abort their requests at the router), no access log, a client's malformed
    request logged in one line."""
    return {"auto_decompress": False, "keepalive_timeout": limits.keepalive,
            "handler_cancellation": True, "access_log": None, "logger": SERVER_LOG}
