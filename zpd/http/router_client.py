"""The HTTP front's connection to the router: one asyncio DEALER for every request.

One reader task takes each message off the socket and hands it on: a request's
token chunks to that request's sink (a plain function, called in the reader task, so
a token costs no task switch here), an admin reply to the future waiting for it.
A request the router does not acknowledge within `connect_timeout`, or any request
in flight once the router has been silent for `router_silence` (it pings every
client with requests in flight, so silence means it is gone), ends with a 503
chunk: every stream the routes read ends, whatever happens to the router.

Each request names its HTTP caller (USER, set per HTTP request by the key check) as
`Generate.user`, so the router's fair queue takes turns between callers, not only
between connections (zpd/router/admission.py). A request is encoded before it is
sent: one whose frame the router would refuse (MAX_FRAME_BYTES) ends here with 400,
since the router drops a connection that sends one, every caller's requests with it.
A request the router's queue refused (429 full, 503 timeout) carries `retry_after`;
`retry_after_header`, a middleware, puts it in the HTTP answer's Retry-After.
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
import uuid
from contextvars import ContextVar
from typing import AsyncIterator, Callable

import zmq
import zmq.asyncio
from aiohttp import web

from zpd.client import Asked, asks_logprobs, chunk_of, generate_message
from zpd.http.records import GenRequest
from zpd.wire.net import Curve, SocketOptions, configure_socket, parse_endpoint
from zpd.wire.protocol import (MAX_FRAME_BYTES, Abort, Accepted, Admin, AdminReply, Message,
                               ProtocolError, TokenPart, Tokens, decode, encode)
from zpd.wire.resume import Resumes, client_identity

log = logging.getLogger("zpd.http.router_client")

UNAVAILABLE = 503
BAD_REQUEST = 400

# Who the current HTTP request is for (`http_user`); "" outside one: the front itself.
USER: ContextVar[str] = ContextVar("zpd_http_user", default="")
# The current HTTP request's longest retry_after from the router's queue, in a dict
# that `retry_after_header` sets per request (None outside one).
RETRY: ContextVar[dict | None] = ContextVar("zpd_http_retry", default=None)
QUEUE_REFUSALS = (429, 503)


@web.middleware
async def retry_after_header(request: web.Request, handler) -> web.StreamResponse:
    """An answer with the status of a queue refusal its requests got (429 or 503, not
    yet sent) says when to retry: Retry-After, seconds, as the router said."""
    noted: dict = {}
    token = RETRY.set(noted)
    try:
        response = await handler(request)
    finally:
        RETRY.reset(token)
    if noted and response.status in QUEUE_REFUSALS and not response.prepared:
        response.headers["Retry-After"] = str(noted["after"])
    return response


def _noting_retry(sink: Sink) -> Sink:
    """`sink`, and the current HTTP request (if any) notes a queue refusal's retry_after."""
    noted = RETRY.get()
    if noted is None:
        return sink

    def note(chunk: dict) -> None:
        after = (chunk.get("finish_reason") or {}).get("retry_after") if chunk["finished"] else None
        if type(after) is int and after > 0:
            noted["after"] = max(after, noted.get("after", 0))
        sink(chunk)
    return note


def http_user(remote: str | None, token: bytes, keyed: bool) -> str:
    """An HTTP caller as the router's fairness sees it: its address and, where API keys
    are set, which key it presented (a hash: the key itself never leaves the front).
    The address is the peer's (never a header a caller writes), without its port, so
    one caller's many connections are one user."""
    who = remote or "unknown"
    if keyed and token:
        who = f"key:{hashlib.sha256(token).hexdigest()[:16]}@{who}"
    return who[:128]

Sink = Callable[[dict], None]       # takes each chunk of one request; the last is finished


def abort_chunk(rid: str, status: int, message: str) -> dict:
    """The last chunk of a request that ended here, without the router's word (its
    meta is empty: the counts are what the chunks before it carried)."""
    return chunk_of(TokenPart.abort(rid, status, message))


class RouterClient:
    """Requests and admin commands to one router, for many asyncio tasks at once."""

    def __init__(self, endpoint: str, curve: Curve | None = None, connect_timeout: float = 5.0,
                 router_silence: float = 10.0, admin_timeout: float = 30.0) -> None:
        self.endpoint, self.curve = endpoint, curve
        self.connect_timeout, self.router_silence = connect_timeout, router_silence
        self.admin_timeout = admin_timeout
        self._sinks: dict[str, Sink] = {}               # rid -> where its chunks go
        self._asked: dict[str, Asked] = {}  # rid -> the logprobs it asked for
        self._unacked: set[str] = set()
        self._replies: dict[str, asyncio.Future] = {}   # admin req_id -> its reply
        self._heard = 0.0                               # when the router last spoke
        self._resumes = Resumes()          # open requests, resumed if the router restarts
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        host, _ = parse_endpoint(self.endpoint)
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        configure_socket(self._sock, host=host, server=False, opts=SocketOptions(curve=self.curve))
        self._sock.setsockopt(zmq.IDENTITY, client_identity())   # see zpd/wire/resume.py
        bracketed = f"[{host}]" if ":" in host else host
        self._sock.connect(f"tcp://{bracketed}:{parse_endpoint(self.endpoint)[1]}")
        self._heard = asyncio.get_running_loop().time()
        self._tasks = [asyncio.create_task(self._read()), asyncio.create_task(self._watch())]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for rid in list(self._sinks):
            self.abort(rid, "the HTTP server is shutting down")
            self._end(rid, abort_chunk(rid, UNAVAILABLE, "the HTTP server is shutting down"))
        if self._sock is not None:
            self._sock.close(linger=100)        # a moment for the aborts just sent
            self._ctx.destroy(linger=0)         # term() alone waits on any socket left open

    # --- requests ---------------------------------------------------------------

    def open(self, req: GenRequest, sink: Sink) -> Callable[[], None]:
        """Submit `req`; every chunk of it goes to `sink(chunk)` as it arrives, ending
        with exactly one finished chunk, whatever happens to the router. Returns
        `close()`: called before the end, it aborts the request (the router answers
        499) and no more chunks come."""
        rid = req.rid or uuid.uuid4().hex
        if rid in self._sinks:
            sink(abort_chunk(rid, 409, f"rid {rid!r} is already in flight"))
            return lambda: None
        self._sinks[rid] = sink = _noting_retry(sink)
        self._asked[rid] = asks_logprobs(req.sampling)
        try:
            self._submit(rid, req)
        except BaseException:          # never sent: the rid must not stay taken (409)
            self._forget(rid)
            raise

        def close() -> None:
            if self._sinks.get(rid) is sink:
                self._forget(rid)
                self.abort(rid, "the HTTP client went away")
        return close

    async def stream(self, req: GenRequest) -> AsyncIterator[dict]:
        """Chunks of one request (zpd.Client.stream's), always ending with a finished one.
        Closed or cancelled before that, it aborts the request (the router answers 499)."""
        queue: asyncio.Queue[dict] = asyncio.Queue()
        close = self.open(req, queue.put_nowait)
        try:
            while True:
                chunk = await queue.get()
                yield chunk
                if chunk["finished"]:
                    return
        finally:
            close()

    def _forget(self, rid: str) -> None:
        self._sinks.pop(rid, None)
        self._asked.pop(rid, None)
        self._unacked.discard(rid)
        self._resumes.closed(rid)

    def _end(self, rid: str, chunk: dict) -> None:
        """Hand `rid`'s sink its last chunk, one made here."""
        sink = self._sinks.get(rid)
        if sink is not None:
            self._forget(rid)
            sink(chunk)

    def _submit(self, rid: str, req: GenRequest) -> None:
        msg = generate_message(req.input_ids, req.text, req.sampling, rid, req.stream, req.messages,
                               USER.get())
        frames = self._frames(rid, msg)
        if frames is None:
            return
        if not self._send(msg, frames):
            self._end(rid, abort_chunk(rid, UNAVAILABLE, f"cannot reach the router "
                                       f"{self.endpoint}: its send queue is full"))
            return
        self._unacked.add(rid)
        loop = asyncio.get_running_loop()
        self._resumes.opened(rid, loop.time())
        self._heard = max(self._heard, loop.time())       # silence counts from here
        loop.call_later(self.connect_timeout, self._check_acked, rid)

    def _frames(self, rid: str, msg: Message) -> list[bytes] | None:
        """`msg` encoded; None (and `rid` ended with 400) where the router would refuse it."""
        try:
            frames = encode(msg)
        except ProtocolError as e:
            self._end(rid, abort_chunk(rid, BAD_REQUEST, f"the request cannot be sent: {e.reason}"))
            return None
        largest = max(len(f) for f in frames)
        if largest > MAX_FRAME_BYTES:
            self._end(rid, abort_chunk(rid, BAD_REQUEST, (
                f"the request is too large: its prompt takes {largest} bytes on the wire, more "
                f"than the router accepts in one frame ({MAX_FRAME_BYTES}); send a shorter one")))
            return None
        return frames

    def _check_acked(self, rid: str) -> None:
        if rid in self._unacked and rid in self._sinks:
            self.abort(rid, "not acknowledged in time")      # in case it arrives late
            self._end(rid, abort_chunk(rid, UNAVAILABLE, f"no answer from the router "
                                       f"{self.endpoint} within {self.connect_timeout:g} s: "
                                       "is it running?"))

    def abort(self, rid: str, reason: str) -> None:
        """Ask the router to end `rid` (one of ours) with 499."""
        self._send(Abort(rid, 499, reason))

    # --- admin ------------------------------------------------------------------

    async def admin(self, command: str, timeout: float | None = None, **args) -> dict:
        """{"ok": bool, **result}; a router that does not answer within `timeout` gives
        {"ok": False, "status": 504, "error": ...}."""
        wait = timeout or self.admin_timeout
        req_id = uuid.uuid4().hex
        # The router answers with what it has a little before we give up.
        reply = self._replies[req_id] = asyncio.get_running_loop().create_future()
        try:
            if not self._send(Admin(command, args | {"timeout": wait * 0.8}, req_id)):
                return {"ok": False, "status": UNAVAILABLE, "error": "router send queue full"}
            return await asyncio.wait_for(reply, wait)
        except asyncio.TimeoutError:
            return {"ok": False, "status": 504, "error": f"no answer from the router "
                                                        f"{self.endpoint} within {wait:g} s"}
        finally:
            self._replies.pop(req_id, None)

    # --- the socket ---------------------------------------------------------------

    def _send(self, msg: Message, frames: list[bytes] | None = None) -> bool:
        """Queue `msg` (as `frames`, if encoded already) without waiting; False when the
        socket's queue is full."""
        done = self._sock.send_multipart(frames or encode(msg), flags=zmq.DONTWAIT)
        if done.exception() is not None:
            log.warning("dropped %s to the router %s: %s", msg.TYPE, self.endpoint, done.exception())
            return False
        return True

    async def _read(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            frames = await self._sock.recv_multipart()
            self._heard = loop.time()
            try:
                msg = decode(frames)
                for resume in self._resumes.note(msg, self._heard):    # the router restarted
                    self._send(resume)
                self._dispatch(msg)
            except ProtocolError as e:
                log.warning("dropped a malformed message from the router: %s", e.reason)
            except Exception:       # a bug here must not stop every other request's reader
                log.exception("handing on a message from the router failed")

    def _dispatch(self, msg: Message) -> None:
        if isinstance(msg, Accepted):
            self._unacked.discard(msg.rid)
        elif isinstance(msg, Tokens):
            for part in msg.unpack():
                sink = self._sinks.get(part.rid)
                if sink is None:
                    continue
                self._resumes.got(part)
                self._unacked.discard(part.rid)
                chunk = chunk_of(part, self._asked[part.rid])
                if chunk["finished"]:
                    self._forget(part.rid)
                try:
                    sink(chunk)
                except Exception as e:      # that request ends; the others go on
                    log.exception("request %s: taking a chunk failed", part.rid)
                    if not chunk["finished"]:
                        self.abort(part.rid, "the HTTP front failed")
                        self._forget(part.rid)
                        self._call_quietly(sink, abort_chunk(part.rid, 500, f"{type(e).__name__}: {e}"))
        elif isinstance(msg, AdminReply):
            reply = self._replies.get(msg.req_id)
            if reply is not None and not reply.done():
                reply.set_result({"ok": msg.ok} | msg.result)
        # anything else (the router's pings) only says it is alive

    @staticmethod
    def _call_quietly(sink: Sink, chunk: dict) -> None:
        try:
            sink(chunk)
        except Exception:
            log.exception("request %s: its sink failed again; dropping it", chunk["rid"])

    async def _watch(self) -> None:
        """End every request in flight once the router has been silent too long."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(min(1.0, self.router_silence / 4))
            ping = self._resumes.probe(loop.time())       # a restarted router answers
            if ping is not None:
                self._send(ping)
            silent = loop.time() - self._heard
            if self._sinks and silent > self.router_silence:
                log.error("router %s silent for %.1f s: ending %d requests", self.endpoint,
                          silent, len(self._sinks))
                for rid in list(self._sinks):
                    self._end(rid, abort_chunk(rid, UNAVAILABLE, f"the router {self.endpoint} "
                                               f"has not answered for {silent:.0f} s"))
                self._heard = loop.time()
