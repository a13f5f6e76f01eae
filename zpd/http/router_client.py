"""The HTTP front's connection to the router: one asyncio DEALER for every request
(one per router where --router names several: zpd/failover.py says which router
takes each request and what happens when one dies).

One reader task takes each message off the socket and hands it on: a request's
token chunks to that request's sink (a plain function, called in the reader task, so
a token costs no task switch here), an admin reply to the future waiting for it.
A request the router does not acknowledge within `connect_timeout`, or any request
in flight once the router has been silent for `router_silence` (it pings every
client with requests in flight, so silence means it is gone), ends with a 503
chunk: every stream the routes read ends, whatever happens to the router.

Each request names its HTTP caller (USER, set per HTTP request by the key check) as
`Generate.user`, and its HTTP request (CALL) as `Generate.call`, so the router's fair
queue takes turns between callers, and between one caller's calls, not only between
connections (zpd/router/admission.py): a bystander is not served after a batch of
1,024 sent from the same address. A request is encoded before it is
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
from typing import AsyncIterator, Callable, Sequence

import zmq
import zmq.asyncio
from aiohttp import web

from zpd.client import NOTHING, Asked, asks_logprobs, chunk_of, generate_message
from zpd.failover import FANNED, PEER_WAIT_S, Routers, merge_replies, parse_routers
from zpd.http.records import GenRequest
from zpd.http.router_link import Link, Unacked
from zpd.wire.net import Curve
from zpd.wire.protocol import (MAX_FRAME_BYTES, Abort, Accepted, Admin, AdminReply, Message,
                               ProtocolError, Rows, TokenPart, Tokens, decode, encode)
from zpd.wire.rows import RowsInbox

log = logging.getLogger("zpd.http.router_client")

UNAVAILABLE = 503
BAD_REQUEST = 400

# Who the current HTTP request is for (`http_user`); "" outside one: the front itself.
USER: ContextVar[str] = ContextVar("zpd_http_user", default="")
# Which HTTP request of that caller (a fresh name per request); "" outside one.
CALL: ContextVar[str] = ContextVar("zpd_http_call", default="")
# The current HTTP request's longest retry_after from the router's queue, in a dict
# that `retry_after_header` sets per request (None outside one).
RETRY: ContextVar[dict | None] = ContextVar("zpd_http_retry", default=None)
QUEUE_REFUSALS = (429, 503)
READ_BURST = 16                 # messages the reader takes before it lets others run


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
    """Requests and admin commands to one router, or to several (`endpoint` a list or
    "h:p,h:p"): zpd/failover.py says which takes what, and what happens when one dies.
    For many asyncio tasks at once."""

    def __init__(self, endpoint: str | Sequence[str], curve: Curve | None = None,
                 connect_timeout: float = 5.0, router_silence: float = 10.0,
                 admin_timeout: float = 30.0, first: int | None = None) -> None:
        """`first`: the index of this front's own router in the list (None: random)."""
        self.routers = Routers(parse_routers(endpoint), first)
        self.endpoint, self.curve = ",".join(self.routers.endpoints), curve
        self.connect_timeout, self.router_silence = connect_timeout, router_silence
        self.admin_timeout = admin_timeout
        self._sinks: dict[str, Sink] = {}               # rid -> where its chunks go
        self._asked: dict[str, Asked] = {}  # rid -> the logprobs it asked for
        self._rows = RowsInbox()            # routed experts ahead of their final part
        self._owner: dict[str, int] = {}                # rid -> the router that has it
        self._unacked: dict[str, Unacked] = {}          # rid -> how to send it elsewhere
        self._replies: dict[str, asyncio.Future] = {}   # admin req_id -> its reply
        self._ctx: zmq.asyncio.Context | None = None
        self._links: list[Link] = []
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        now = asyncio.get_running_loop().time()
        self._links = [Link(self._ctx, e, self.curve, now) for e in self.routers.endpoints]
        self._tasks = [asyncio.create_task(self._watch())]
        for i in range(len(self._links)):
            self._tasks += [asyncio.create_task(self._read(i)),
                            asyncio.create_task(self._follow(i))]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for rid in list(self._sinks):
            self.abort(rid, "the HTTP server is shutting down")
            self._end(rid, abort_chunk(rid, UNAVAILABLE, "the HTTP server is shutting down"))
        for link in self._links:
            link.close(linger=100)              # a moment for the aborts just sent
        if self._ctx is not None:
            self._ctx.destroy(linger=0)         # term() alone waits on any socket left open

    def _now(self) -> float:
        return asyncio.get_running_loop().time()

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
        asked = asks_logprobs(req.sampling)
        self._asked[rid] = NOTHING if asked == NOTHING else asked     # `is NOTHING`: no logprobs
        try:
            self._submit(rid, req)
        except BaseException:          # never sent: the rid must not stay taken (409)
            self._forget(rid)
            raise

        def close() -> None:
            if self._sinks.get(rid) is sink:
                self.abort(rid, "the HTTP client went away")
                self._forget(rid)
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
        self._rows.waiting.pop(rid, None)
        self._asked.pop(rid, None)
        self._unacked.pop(rid, None)
        i = self._owner.pop(rid, None)
        if i is not None:
            self._links[i].resumes.closed(rid)

    def _end(self, rid: str, chunk: dict) -> None:
        """Hand `rid`'s sink its last chunk, one made here."""
        sink = self._sinks.get(rid)
        if sink is not None:
            self._forget(rid)
            sink(chunk)

    def _submit(self, rid: str, req: GenRequest) -> None:
        msg = generate_message(req.input_ids, req.text, req.sampling, rid, req.stream, req.messages,
                               USER.get(), CALL.get(), req.chat_extra)
        frames = self._frames(rid, msg)
        if frames is not None:
            self._send_to(self.routers.pick(self._now()), rid, Unacked(msg, frames))

    def _send_to(self, i: int, rid: str, pending: Unacked) -> None:
        """Send `rid` to router `i`; it must acknowledge within connect_timeout."""
        link = self._links[i]
        if not self._send(pending.msg, pending.frames, i):
            self._end(rid, abort_chunk(rid, UNAVAILABLE, f"cannot reach the router "
                                       f"{link.endpoint}: its send queue is full"))
            return
        self._owner[rid], self._unacked[rid] = i, pending
        pending.tried.add(i)
        loop = asyncio.get_running_loop()
        link.resumes.opened(rid, loop.time())
        link.heard = max(link.heard, loop.time())       # silence counts from here
        loop.call_later(self.connect_timeout, self._check_acked, rid, i)

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

    def _check_acked(self, rid: str, i: int) -> None:
        if rid in self._unacked and self._owner.get(rid) == i and rid in self._sinks:
            self.routers.down(i, self._now())
            self._retry(rid, f"no answer from the router {self._links[i].endpoint} within "
                             f"{self.connect_timeout:g} s: is it running?")

    def _retry(self, rid: str, why: str) -> None:
        """`rid`, never acknowledged, to the next router up (its last one is told to
        drop it, in case it arrives late); with none left, it ends with 503 `why`."""
        self.abort(rid, "not acknowledged in time")
        self._links[self._owner[rid]].resumes.closed(rid)
        pending = self._unacked[rid]
        j = self.routers.next_up(self._now(), pending.tried)
        if j is None:
            self._end(rid, abort_chunk(rid, UNAVAILABLE, why))
        else:
            log.warning("request %s: %s; sending it to %s", rid, why, self._links[j].endpoint)
            self._send_to(j, rid, pending)

    def abort(self, rid: str, reason: str) -> None:
        """Ask the router that has `rid` (one of ours) to end it with 499."""
        self._send(Abort(rid, 499, reason), to=self._owner.get(rid, 0))

    # --- admin ------------------------------------------------------------------

    async def admin(self, command: str, timeout: float | None = None, **args) -> dict:
        """{"ok": bool, **result}; a router that does not answer within `timeout` gives
        {"ok": False, "status": 504, "error": ...}. Aborts go to every router up, the
        rest to the coordinator (zpd/failover.py)."""
        now = self._now()
        if command in FANNED:               # the first answers within timeout, the rest sooner
            wait = timeout or self.admin_timeout
            targets = self.routers.fanned(now)
            replies = await asyncio.gather(*(
                self._admin(i, command, wait if k == 0 else min(wait, PEER_WAIT_S), args)
                for k, i in enumerate(targets)))
            return merge_replies(command, list(replies))
        return await self._admin(self.routers.coordinator(now), command, timeout, args)

    async def _admin(self, i: int, command: str, timeout: float | None, args: dict) -> dict:
        wait = timeout or self.admin_timeout
        req_id, link = uuid.uuid4().hex, self._links[i]
        # The router answers with what it has a little before we give up.
        reply = self._replies[req_id] = asyncio.get_running_loop().create_future()
        sent = self._now()
        try:
            if not self._send(Admin(command, args | {"timeout": wait * 0.8}, req_id), to=i):
                return {"ok": False, "status": UNAVAILABLE, "error": "router send queue full"}
            return await asyncio.wait_for(reply, wait)
        except asyncio.TimeoutError:
            if link.heard < sent:               # not a slow command: a silent router
                self.routers.down(i, self._now())
            return {"ok": False, "status": 504, "error": f"no answer from the router "
                                                        f"{link.endpoint} within {wait:g} s"}
        finally:
            self._replies.pop(req_id, None)

    # --- the sockets --------------------------------------------------------------

    def _send(self, msg: Message, frames: list[bytes] | None = None, to: int = 0) -> bool:
        """Queue `msg` (as `frames`, if encoded already) for router `to` without
        waiting; False when the socket's queue is full."""
        return self._links[to].send(msg, frames)

    async def _read(self, i: int) -> None:
        link, taken = self._links[i], 0
        while True:
            taken += 1
            if taken % READ_BURST == 0:
                # A message waiting is taken without a turn of the loop: let the
                # streams write what the messages so far brought (their flushes), and
                # the HTTP side run, before taking more.
                await asyncio.sleep(0)
            frames = await link.recv()
            link.heard = self._now()
            self.routers.heard(i)
            try:
                msg = decode(frames)
                for resume in link.resumes.note(msg, link.heard):    # the router restarted
                    self._send(resume, to=i)
                self._dispatch(msg, i)
            except ProtocolError as e:
                log.warning("dropped a malformed message from the router: %s", e.reason)
            except Exception:       # a bug here must not stop every other request's reader
                log.exception("handing on a message from the router failed")

    async def _follow(self, i: int) -> None:
        """Router `i`'s connection events: once it drops, new requests go elsewhere and
        so do those it never acknowledged; the rest wait for it to come back (resumed)
        or for the silence watch (503)."""
        link = self._links[i]
        while True:
            if self.routers.link_event(i, await link.event()):
                for _ in range(10_000):         # what it said before (an ack) counts
                    if not link.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                        break
                    await asyncio.sleep(0)      # the reader takes it
                why = f"the connection to the router {link.endpoint} dropped"
                for rid in [r for r, owner in self._owner.items() if owner == i]:
                    if rid in self._unacked and self.routers.next_up(self._now(), {i}) is not None:
                        self._retry(rid, why)

    def _dispatch(self, msg: Message, i: int) -> None:
        if isinstance(msg, Accepted):
            for rid in msg.rids:
                if self._owner.get(rid) == i:
                    self._unacked.pop(rid, None)
        elif isinstance(msg, Tokens):
            owner, got, take = self._owner.get, self._links[i].resumes.got, self._take
            for part in msg.unpack():
                if owner(part.rid, i) != i:    # a late copy of one sent elsewhere
                    if not part.finished:
                        self._send(Abort(part.rid, 499, "sent to another router"), to=i)
                    continue
                part = got(part)        # what it has not had
                if part is not None:
                    take(part)
        elif isinstance(msg, Rows):           # a request's routed experts, before its end
            if self._owner.get(msg.rid) == i and msg.rid in self._sinks:
                self._rows.take(msg)
        elif isinstance(msg, AdminReply):
            reply = self._replies.get(msg.req_id)
            if reply is not None and not reply.done():
                reply.set_result({"ok": msg.ok} | msg.result)
        # anything else (the router's pings) only says it is alive

    def _take(self, part: TokenPart) -> None:
        """Hand `part` to its request's sink, as a chunk (zpd.Client.stream's shape)."""
        sink = self._sinks.get(part.rid)
        if sink is None:
            return
        if self._unacked:
            self._unacked.pop(part.rid, None)
        if part.finish is None and part.logprobs is None and part.ids_logprobs is None \
                and self._asked[part.rid] is NOTHING:
            # most parts: new tokens alone (the part's lists are its own: no copies)
            chunk = {"rid": part.rid, "token_ids": part.token_ids,
                     "weight_versions": part.weight_versions, "finished": False}
        else:
            chunk = chunk_of(self._rows.finish(part), self._asked[part.rid])
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

    @staticmethod
    def _call_quietly(sink: Sink, chunk: dict) -> None:
        try:
            sink(chunk)
        except Exception:
            log.exception("request %s: its sink failed again; dropping it", chunk["rid"])

    def _lost(self, i: int, why: str) -> None:
        """Router `i` is silent: what it never acknowledged goes to another; the rest
        ends with 503."""
        mine = [rid for rid, owner in self._owner.items() if owner == i]
        log.error("%s: ending or moving its %d requests", why, len(mine))
        for rid in mine:
            if rid in self._unacked:
                self._retry(rid, why)
            else:
                self._end(rid, abort_chunk(rid, UNAVAILABLE, why))

    async def _watch(self) -> None:
        """End every request in flight on a router that has been silent too long."""
        while True:
            await asyncio.sleep(min(1.0, self.router_silence / 4))
            now = self._now()
            busy = set(self._owner.values())
            for i, link in enumerate(self._links):
                ping = link.resumes.probe(now)          # a restarted router answers
                if ping is not None:
                    self._send(ping, to=i)
                silent = now - link.heard
                if i in busy and silent > self.router_silence:
                    self.routers.down(i, now)
                    self._lost(i, f"the router {link.endpoint} has not answered for "
                                  f"{silent:.0f} s")
                    link.heard = now

