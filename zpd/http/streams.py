"""Running a route's requests and streaming their answers as server-sent events.

`follow` runs every request of one HTTP call at once (a batch, or n copies) and
yields each Output as a chunk of it arrives. The backend hands chunks to a sink that
adds each to its Output at once and queues the Output for the route's task (once
while it waits), so a token costs one task switch, the route's, and a route that
cannot write holds its requests' answers so far, never a backlog of chunks.
Leaving `follow` early, by an error or by the handler's cancellation when the HTTP
client disconnects, closes every request, and each closed one is aborted at the
router (499).

An EventStream never lets a client that stops reading hold the front's memory or the
workers' pages: past `buffer_bytes` unsent its writes wait for the client, and a write
that waits `write_timeout` seconds raises Stalled; the route then leaves `follow` (its
requests are aborted) and `abandon`s the connection. The socket's kernel send buffer is
set to `buffer_bytes` too, so that a client that reads nothing is found out after that
much, not after the megabytes Linux lets a loopback socket grow to. All streams of the
front share a StreamBudget: while their unsent bytes together pass its bound, a stream
with anything unsent waits until its client has taken all of it (30 clients that never
read held 1 MiB each, +49 MB of the front's memory, for 60 s).
"""
from __future__ import annotations

import asyncio
import logging
import socket
from contextlib import aclosing
from typing import AsyncIterator, Awaitable, Callable, Protocol

import orjson
from aiohttp import web

from engines.formats.tokenizer import Tokenizer
from zpd.http.output import Output
from zpd.http.records import BadRequest, GenRequest
from zpd.http.router_client import abort_chunk

log = logging.getLogger("zpd.http.streams")

DONE = b"data: [DONE]\n\n"
DRAIN_POLL_S = 0.05
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
               "X-Accel-Buffering": "no"}


class Stalled(Exception):
    """The client has read nothing of its stream for the write timeout."""


class StreamBudget:
    """The unsent bytes of every open stream of one front, against one bound."""

    def __init__(self, total_bytes: int) -> None:
        self.total_bytes = total_bytes
        self.transports: set[asyncio.BaseTransport] = set()   # those of open streams

    def add(self, transport: asyncio.BaseTransport) -> None:
        self.transports.add(transport)

    def unsent(self) -> int:
        """What the open streams hold unsent; forgets those that closed."""
        self.transports = {t for t in self.transports if not t.is_closing()}
        return sum(t.get_write_buffer_size() for t in self.transports)

    def over(self) -> bool:
        return self.unsent() > self.total_bytes


class Backend(Protocol):
    """What the routes need of the router: RouterClient, or a fake in unit tests."""

    def open(self, req: GenRequest, sink: Callable[[dict], None]) -> Callable[[], None]: ...

    async def admin(self, command: str, timeout: float | None = None, **args) -> dict: ...


async def follow(backend: Backend, items: list[GenRequest],
                 tokenizer: Tokenizer | None) -> AsyncIterator[Output]:
    """Each request's Output whenever a chunk of it arrives, until all have finished."""
    outputs = [Output(i, req, tokenizer) for i, req in enumerate(items)]
    ready: asyncio.Queue[Output] = asyncio.Queue()
    closers: list[Callable[[], None]] = []
    try:
        for req, out in zip(items, outputs):
            closers.append(_open(backend, req, out, ready))
        done: set[int] = set()
        while len(done) < len(outputs):
            # Every Output that moved is taken at once and yielded once: a front that
            # falls behind the decode writes one event per request for several tokens
            # instead of one per token (nothing is lost: events carry what is new since
            # the last, or everything so far), and so catches up.
            got = [await ready.get()]
            while not ready.empty():
                got.append(ready.get_nowait())
            for out in got:
                out.queued = False
                if out.failure is not None:
                    raise out.failure
                if out.finished:
                    done.add(out.index)
                yield out
    finally:
        for close in closers:
            close()


def _open(backend: Backend, req: GenRequest, out: Output, ready: asyncio.Queue) -> Callable[[], None]:
    """Submit one request, each chunk added to its Output as it comes; a backend that
    fails to take it ends the Output with a 500 instead of failing the others."""
    def sink(chunk: dict) -> None:
        try:
            out.add(chunk)
        except Exception as e:      # the route fails with it, not the backend's receiver
            out.failure = e
        if not out.queued:
            out.queued = True
            ready.put_nowait(out)
    try:
        return backend.open(req, sink)
    except Exception as e:
        log.exception("request %s: submitting it failed", req.rid or "?")
        sink(abort_chunk(req.rid or "", 500, f"{type(e).__name__}: {e}"))
        return lambda: None


async def run_all(backend: Backend, items: list[GenRequest], tokenizer: Tokenizer | None,
                  max_bytes: int | None = None) -> list[Output]:
    """Every request run to its end; the Outputs in the order of `items`. An answer that
    passes `max_bytes` (--max-answer-bytes, about: Output.held) is BadRequest, and every
    request of the call still running is aborted at the router."""
    done: dict[int, Output] = {}
    held: dict[int, int] = {}
    async with aclosing(follow(backend, items, tokenizer)) as outs:
        async for out in outs:
            held[out.index] = out.held
            if max_bytes is not None and sum(held.values()) > max_bytes:
                raise BadRequest(f"the answer to this call passed the front's --max-answer-bytes "
                                 f"({max_bytes}) at {sum(held.values())} bytes, with {len(done)} of "
                                 f"its {len(items)} request(s) done; they were aborted: split it "
                                 "into smaller calls or ask fewer tokens or logprobs")
            if out.finished:
                done[out.index] = out
    return [done[i] for i in range(len(items))]


class EventStream:
    """An SSE answer, opened only at its first event so that a request refused before
    anything was generated can still be answered with a plain HTTP error.

    The transport pauses past `buffer_bytes` unsent, and aiohttp waits for it to drain
    at least every 64 KiB written: what one stream holds unsent is at most
    buffer_bytes + 64 KiB + one event (the event size is capped by the routes)."""

    def __init__(self, request: web.Request, write_timeout: float = 10.0,
                 buffer_bytes: int = 256 << 10, budget: StreamBudget | None = None) -> None:
        self.request = request
        self.response: web.StreamResponse | None = None
        self.write_timeout, self.buffer_bytes = write_timeout, buffer_bytes
        self.budget = budget

    async def send(self, obj: dict, event: str | None = None) -> int:
        """Write one event (named `event` where given); its size in bytes."""
        data = (f"event: {event}\n".encode() if event else b"") + \
            b"data: " + orjson.dumps(obj) + b"\n\n"
        await self._write(data)
        return len(data)

    async def close(self, done: bool = True) -> web.StreamResponse:
        """Write [DONE] (where `done`) and end the answer."""
        if done:
            await self._write(DONE)
        await self._bounded(self.response.write_eof())
        return self.response

    def abandon(self, rids: list[str]) -> web.StreamResponse:
        """Drop the connection of a stalled stream and what it has unsent (its requests
        were aborted when the route left `follow`)."""
        named = [r for r in rids if r]
        log.warning("stream to %s: the client read nothing for %g s; its connection is closed "
                    "and its %d request(s) aborted%s", self.request.remote or "?",
                    self.write_timeout, len(rids),
                    f" ({', '.join(named[:4])}{', ...' if len(named) > 4 else ''})" if named else "")
        if self.request.transport is not None:
            self.request.transport.abort()
        return self.response

    async def _write(self, data: bytes) -> None:
        if self.response is None:
            self.response = web.StreamResponse(headers=SSE_HEADERS)
            await self.response.prepare(self.request)
            self._limit_buffer()
        await self._bounded(self.response.write(data))
        if self.budget is not None and self._unsent() and self.budget.over():
            await self._bounded(self._drained())

    def _limit_buffer(self) -> None:
        transport = self.request.transport
        try:
            transport.set_write_buffer_limits(high=self.buffer_bytes)
        except (AttributeError, NotImplementedError):    # no transport, or one without limits
            return
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.buffer_bytes)
        if self.budget is not None:
            self.budget.add(transport)

    def _unsent(self) -> int:
        transport = self.request.transport
        return 0 if transport is None or transport.is_closing() else transport.get_write_buffer_size()

    async def _drained(self) -> None:
        """Until the client has taken all this stream holds unsent (the front's streams
        together hold more than their budget)."""
        while self._unsent():
            await asyncio.sleep(DRAIN_POLL_S)

    async def _bounded(self, write: Awaitable[None]) -> None:
        try:
            async with asyncio.timeout(self.write_timeout):
                await write
        except TimeoutError:
            raise Stalled() from None
