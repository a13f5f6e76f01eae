"""Running a route's requests and streaming their answers as server-sent events.

`follow` runs every request of one HTTP call at once (a batch, or n copies) and
yields each Output as a chunk of it arrives. The backend hands chunks to a sink that
adds each to its Output at once and queues the Output for the route's task (once
while it waits), so a route that cannot keep up holds its requests' answers so far,
never a backlog of chunks. `pump` runs a streamed call's requests the same way but
writes their events itself, from the backend's reader, without a task switch per
event (Pump). Leaving either early, by an error or by the handler's cancellation
when the HTTP client disconnects, closes every request, and each closed one is
aborted at the router (499).

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


async def follow(backend: Backend, items: list[GenRequest], tokenizer: Tokenizer | None,
                 incremental: bool = True) -> AsyncIterator[Output]:
    """Each request's Output whenever a chunk of it arrives, until all have finished;
    not `incremental`, their text only once finished (Output)."""
    outputs = [Output(i, req, tokenizer, incremental) for i, req in enumerate(items)]
    ready: asyncio.Queue[Output] = asyncio.Queue()
    closers: list[Callable[[], None]] = []
    try:
        for req, out in zip(items, outputs):
            closers.append(_open(backend, req, out, _queued(out, ready)))
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


def _queued(out: Output, ready: asyncio.Queue) -> Callable[[dict], None]:
    """A sink that adds each chunk to `out` and queues it for the route's task (once
    while it waits)."""
    def sink(chunk: dict) -> None:
        try:
            out.add(chunk)
        except Exception as e:      # the route fails with it, not the backend's receiver
            out.failure = e
        if not out.queued:
            out.queued = True
            ready.put_nowait(out)
    return sink


def _open(backend: Backend, req: GenRequest, out: Output, sink: Callable[[dict], None]
          ) -> Callable[[], None]:
    """Submit one request, each chunk to `sink`; a backend that fails to take it ends
    the Output with a 500 instead of failing the others."""
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
    async with aclosing(follow(backend, items, tokenizer, incremental=False)) as outs:
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


Render = Callable[[Output], "bytes | None"]


async def pump(backend: Backend, items: list[GenRequest], tokenizer: Tokenizer | None,
               events: "EventStream", render: Render) -> None:
    """Run every request of one streamed call to its end, writing `render(out)`'s
    events (serialized; None or b"": none due) each time an Output moved. See Pump."""
    await Pump(items, tokenizer, events, render).run(backend, items)


class Pump:
    """One streamed call's requests and their events.

    The backend hands each chunk to a sink, in its reader (zpd/http/router_client.py),
    which adds it to its Output and, once per call until written, schedules `flush`
    (call_soon): it runs once the reader has taken every message waiting, so each
    request gets one event for all it received meanwhile (a decode step's tokens, or
    several steps' when the front falls behind), built by `render` and written at once
    (EventStream.write_now) when the stream holds nothing unsent: a token costs no task
    switch. The call's task writes instead whenever that cannot be: the first event
    (the answer may still be an HTTP error), a stream with bytes unsent (its writes
    wait, bounded: Stalled), a failure, and the end."""

    def __init__(self, items: list[GenRequest], tokenizer: Tokenizer | None,
                 events: "EventStream", render: Render) -> None:
        self.outputs = [Output(i, req, tokenizer) for i, req in enumerate(items)]
        self.events, self.render = events, render
        self.moved: list[Output] = []       # Outputs with news not yet rendered, in order
        self.pending = b""                  # rendered, for the task to write
        self.left = len(items)              # not yet rendered finished
        self.failure: BaseException | None = None
        self.busy = True                    # the task is writing (or yet to start)
        self.scheduled = False
        self.wake: asyncio.Future | None = None
        self.loop = asyncio.get_running_loop()

    def sink(self, out: Output) -> Callable[[dict], None]:
        def take(chunk: dict) -> None:
            try:
                out.add(chunk)
            except Exception as e:      # the route fails with it, not the backend's receiver
                out.failure = e
            if not out.queued:
                out.queued = True
                self.moved.append(out)
                if not self.scheduled:
                    self.scheduled = True
                    self.loop.call_soon(self.flush)
        return take

    def flush(self) -> None:
        """Write the events of the Outputs that moved, or wake the task to."""
        self.scheduled = False
        if self.busy or not self.moved:
            return self._wake()
        try:
            data = self._render()
            if data and not self.events.write_now(data):
                self.pending += data
        except Exception as e:          # the task raises it
            self.failure = e
        if self.failure is not None or not self.left or self.pending or self.events.backlogged():
            self._wake()

    def _wake(self) -> None:
        if self.wake is not None and not self.wake.done():
            self.wake.set_result(None)

    def _render(self) -> bytes:
        moved, self.moved = self.moved, []
        datas = []
        for out in moved:
            out.queued = False
            if out.failure is not None:
                self.failure = out.failure
                break
            data = self.render(out)
            if data:
                datas.append(data)
            if out.finished:
                self.left -= 1
        return b"".join(datas)

    async def run(self, backend: Backend, items: list[GenRequest]) -> None:
        closers: list[Callable[[], None]] = []
        try:
            for req, out in zip(items, self.outputs):
                closers.append(_open(backend, req, out, self.sink(out)))
            while True:
                if self.failure is not None:
                    raise self.failure
                data, self.pending = self.pending + self._render(), b""
                if self.failure is not None:
                    raise self.failure
                if data or self.events.backlogged():
                    await self.events.write(data)
                if not self.left and not self.moved:
                    return
                if not self.moved:
                    self.busy, self.wake = False, self.loop.create_future()
                    try:
                        await self.wake
                    finally:
                        self.busy, self.wake = True, None
        finally:
            for close in closers:
                close()


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
        self._chunked: bool | None = None   # known once the headers are out

    async def send(self, obj: dict, event: str | None = None) -> int:
        """Write one event (named `event` where given); its size in bytes."""
        data = (f"event: {event}\n".encode() if event else b"") + \
            b"data: " + orjson.dumps(obj) + b"\n\n"
        await self._write(data)
        return len(data)

    async def write(self, data: bytes) -> None:
        """Write events already serialized (each b"data: ...\\n\\n")."""
        await self._write(data)

    def write_now(self, data: bytes) -> bool:
        """Write `data` (events already serialized) without waiting, where the stream
        is open and holds nothing unsent: the kernel takes it, or the transport holds
        it (then `backlogged`, and the next write waits as `write` does). False, with
        nothing written, where it cannot: then `write` must."""
        transport = self.request.transport
        if self._chunked is None or transport is None or transport.is_closing() or \
                transport.get_write_buffer_size():
            return False
        transport.write(b"%x\r\n%b\r\n" % (len(data), data) if self._chunked else data)
        return True

    def backlogged(self) -> bool:
        """Whether the transport holds something unsent (a write must wait, bounded)."""
        return self._unsent() > 0

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
        if data:
            await self._bounded(self.response.write(data))
            # the headers are out with the first event: write_now may frame events itself
            self._chunked = self.response.headers.get("Transfer-Encoding") == "chunked"
        await self.settle()

    async def settle(self) -> None:
        """Wait (bounded: Stalled) while this stream holds more than `buffer_bytes`
        unsent (write_now's writes pass aiohttp's own count), or holds anything while
        all streams together pass their budget."""
        if self._unsent() > self.buffer_bytes:
            await self._bounded(self._drained(self.buffer_bytes))
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

    async def _drained(self, left: int = 0) -> None:
        """Until the client has taken all but `left` bytes of what this stream holds
        unsent."""
        while self._unsent() > left:
            await asyncio.sleep(DRAIN_POLL_S)

    async def _bounded(self, write: Awaitable[None]) -> None:
        try:
            async with asyncio.timeout(self.write_timeout):
                await write
        except TimeoutError:
            raise Stalled() from None
