"""`zpd.Client`: submit requests, stream tokens and send admin commands to a router
(or admin commands straight to one worker)."""
from __future__ import annotations

import time
import uuid
import weakref
from collections import deque
from typing import Iterator, NamedTuple

import zmq

from zpd.wire.net import Curve, Dealer, SocketOptions
from zpd.wire.protocol import (Abort, Accepted, Admin, AdminReply, Generate, Message, TokenPart,
                               Tokens)
from zpd.wire.resume import Resumes, client_identity


class NoAnswerError(TimeoutError):
    """A request was not acknowledged within the client's `connect_timeout`: nothing
    listens at the address, or what listens there is not a zpd router."""


class Client:
    """One DEALER connection; not thread-safe (use one Client per thread)."""

    def __init__(self, endpoint: str, timeout: float = 300.0, curve: Curve | None = None,
                 connect_timeout: float = 5.0) -> None:
        """`timeout`: seconds to wait for each answer. `connect_timeout`: seconds within
        which the router must acknowledge each request submitted, else NoAnswerError (a
        TimeoutError), so a wrong address fails fast. `curve`: this client's CURVE keys
        (`zpd.wire.security.client_curve`) for a cluster started with --curve-keys;
        None speaks plaintext."""
        self.endpoint, self.timeout, self.connect_timeout = endpoint, timeout, connect_timeout
        self._ctx = zmq.Context()
        try:
            # one identity for good: a restarted router gives requests back only to it
            self._dealer = Dealer(self._ctx, endpoint, identity=client_identity(),
                                  opts=SocketOptions(curve=curve))
        except BaseException:
            self._ctx.destroy(linger=0)
            raise
        # Also runs if the Client is dropped unclosed: a context left to the garbage
        # collector may be finalized before its socket and then wait on it forever.
        self._closer = weakref.finalize(self, _shut, self._dealer, self._ctx)
        self._closer.atexit = False   # at exit a daemon thread may still be reading
        self._parts: deque[TokenPart] = deque()     # the rest of a batched `Tokens` message
        self._unacked: dict[str, float] = {}        # rid -> when its acknowledgement is due
        self._asked: dict[str, Asked] = {}          # rid -> the logprobs it asked for
        self._resumes = Resumes(time.monotonic())   # open requests, for a router restart

    def close(self) -> None:
        """Close the connection, dropping unsent messages; a second call does nothing.
        Call it from the thread that uses the Client, after any reader has stopped:
        a socket closed under a thread blocked in `receive` is undefined behaviour."""
        self._closer()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- generation ---------------------------------------------------------------

    def generate(self, input_ids: list[int] | None = None, prompt: str | None = None,
                 sampling_params: dict | None = None, rid: str | None = None,
                 messages: list[dict] | None = None) -> dict:
        """Run one request to the end; returns the response dict (DESIGN.md contract).
        The prompt is exactly one of `input_ids`, `prompt` (text) or `messages` (a
        conversation [{"role", "content"}, ...] that the workers render with the model's
        chat template, ready for the assistant's turn)."""
        return self.generate_many([{"input_ids": input_ids, "prompt": prompt,
                                    "sampling_params": sampling_params, "rid": rid,
                                    "messages": messages}])[0]

    def generate_many(self, requests: list[dict]) -> list[dict]:
        """Submit all requests at once (they run concurrently); responses in order."""
        rids = [self.submit(**r) for r in requests]
        parts: dict[str, list[dict]] = {rid: [] for rid in rids}
        done: dict[str, dict] = {}
        while len(done) < len(rids):
            chunk = self.receive()
            if chunk["rid"] in parts and chunk["rid"] not in done:
                parts[chunk["rid"]].append(chunk)
                if chunk["finished"]:
                    done[chunk["rid"]] = assemble(parts[chunk["rid"]])
        return [done[rid] for rid in rids]

    def submit(self, input_ids: list[int] | None = None, prompt: str | None = None,
               sampling_params: dict | None = None, rid: str | None = None,
               stream: bool = False, messages: list[dict] | None = None) -> str:
        """Send a request without waiting; returns its rid. Read answers with `receive`."""
        return self._submit(input_ids, prompt, sampling_params, rid, stream, messages)

    def receive(self, timeout: float | None = None) -> dict:
        """The next chunk for any submitted request (see `stream` for its fields)."""
        return self._chunk(self._next(TokenPart, "a token", timeout))

    def stream(self, input_ids: list[int] | None = None, prompt: str | None = None,
               sampling_params: dict | None = None, rid: str | None = None,
               messages: list[dict] | None = None) -> Iterator[dict]:
        """Yield chunks {rid, token_ids, weight_versions, finished} as tokens are made; the
        last chunk also has finish_reason, meta and text. A request that asked for
        logprobs (`return_logprob`) has "logprobs" in every chunk, one per token id, and
        one that asked for `top_logprobs_num` N also "top_logprobs", per token its N most
        likely [token_id, logprob] pairs, highest first, and one that asked for
        `token_ids_logprob` also "token_ids_logprobs", per token those ids' [token_id,
        logprob] pairs in the order asked; with `logprob_start_len` the
        last chunk's meta has the prompt's (input_*) too (docs/serving.md, "Logprobs"). Closing
        the iterator early aborts the request (499)."""
        rid = self._submit(input_ids, prompt, sampling_params, rid, True, messages)
        finished = False
        try:
            while not finished:
                msg = self._next(TokenPart, "a token")
                if msg.rid != rid:
                    continue
                finished = msg.finished
                yield self._chunk(msg)
        finally:
            if not finished:
                self.abort(rid, "client closed the stream")

    def _chunk(self, msg: TokenPart) -> dict:
        """One part as a chunk; a finished request is forgotten here."""
        asked = self._asked.pop(msg.rid, NOTHING) if msg.finished else \
            self._asked.get(msg.rid, NOTHING)
        return chunk_of(msg, asked)

    def abort(self, rid: str, reason: str = "aborted by client") -> None:
        self._resumes.closed(rid)
        self._dealer.send(Abort(rid, 499, reason))

    def _submit(self, input_ids: list[int] | None = None, prompt: str | None = None,
                sampling_params: dict | None = None, rid: str | None = None,
                stream: bool = False, messages: list[dict] | None = None) -> str:
        msg = generate_message(input_ids, prompt, sampling_params, rid or uuid.uuid4().hex,
                               stream, messages)
        asked = asks_logprobs(msg.sampling)
        if asked != NOTHING:
            self._asked[msg.rid] = asked
        self._dealer.send(msg)
        self._unacked[msg.rid] = time.monotonic() + self.connect_timeout
        self._resumes.opened(msg.rid, time.monotonic())
        return msg.rid

    # --- admin ----------------------------------------------------------------------

    def admin(self, command: str, timeout: float | None = None, **args) -> dict:
        """Send an admin command; returns {"ok": bool, **result}. `timeout` bounds the
        whole call (TimeoutError after it)."""
        req_id = uuid.uuid4().hex
        if timeout is not None:
            # A router answers with what it has (missing workers marked 504) a little
            # before we give up, so one dead worker still yields the others' results.
            args["timeout"] = timeout * 0.8
        self._dealer.send(Admin(command, args, req_id))
        wait = timeout or self.timeout
        while True:
            msg = self._next(AdminReply, f"the {command!r} reply", wait)
            if msg.req_id == req_id:
                return {"ok": msg.ok} | msg.result

    def _next(self, kind: type, what: str, timeout: float | None = None) -> Message | TokenPart:
        """The next `kind` (a message type, or TokenPart for one request's tokens);
        acknowledgements are taken on the way and never returned."""
        if kind is TokenPart and self._parts:
            return self._parts.popleft()
        deadline = time.monotonic() + (timeout or self.timeout)
        while True:
            now = time.monotonic()
            msg = self._dealer.recv(timeout=max(0.0, min(deadline - now, self._ack_wait(now),
                                                         self._resumes.wait(now))))
            got = self._take(msg, kind) if msg is not None else None
            if got is not None:
                return got
            if msg is None:                 # nothing pending: is anything overdue?
                now = time.monotonic()
                self._probe(now)
                self._check_acked(now)
                if now >= deadline:
                    raise TimeoutError(f"no answer from {self.endpoint} within "
                                       f"{timeout or self.timeout:.0f} s while waiting for {what}")

    def _take(self, msg: Message, kind: type) -> Message | TokenPart | None:
        """Note what `msg` tells; return it (or its first part) if it is a `kind`."""
        for resume in self._resumes.note(msg, time.monotonic()):    # the router restarted
            self._dealer.send(resume)
        if isinstance(msg, Accepted):
            self._unacked.pop(msg.rid, None)
        elif isinstance(msg, Tokens):            # several requests' tokens at once
            parts = msg.unpack()
            for part in parts:                   # an answer implies the request arrived
                self._unacked.pop(part.rid, None)
                self._resumes.got(part)
            self._parts.extend(parts)
            if kind is TokenPart and self._parts:
                return self._parts.popleft()
        elif isinstance(msg, kind):
            return msg
        return None

    def _probe(self, now: float) -> None:
        """Requests open and the router silent: ping it (a restarted one answers with
        its boot id, and the requests are resumed)."""
        ping = self._resumes.probe(now)
        if ping is not None:
            self._dealer.send(ping)

    def _ack_wait(self, now: float) -> float:
        """Seconds until the next acknowledgement is due (a long time if none is)."""
        return min(self._unacked.values(), default=now + self.timeout) - now

    def _check_acked(self, now: float) -> None:
        """Raise NoAnswerError for requests whose acknowledgement is overdue (forgotten
        then, so a later call waits as usual)."""
        late = [rid for rid, due in self._unacked.items() if due <= now]
        if not late:
            return
        for rid in late:
            del self._unacked[rid]
        raise NoAnswerError(f"no answer from router {self.endpoint} within "
                            f"{self.connect_timeout:g} s: is a router running there?")


def _shut(dealer: Dealer, ctx: zmq.Context) -> None:
    # linger 0 throughout: term() would otherwise wait for any socket still open
    dealer.close()
    ctx.destroy(linger=0)


class Asked(NamedTuple):
    """The output logprobs a request asked for: each token's, its top alternatives, and
    those of the token_ids_logprob ids (which the answer pairs with its values)."""
    logprobs: bool = False
    top: bool = False
    ids: tuple[int, ...] = ()


NOTHING = Asked()


def asks_logprobs(sampling: dict) -> Asked:
    """The output logprobs as the sampling parameters ask for them (the workers refuse
    malformed ones; these are then never read)."""
    top = sampling.get("top_logprobs_num")
    top = type(top) is int and top > 0
    wants = sampling.get("return_logprob") is True or top
    ids = sampling.get("token_ids_logprob")
    ids = (ids,) if type(ids) is int else tuple(ids) if isinstance(ids, (list, tuple)) else ()
    return Asked(wants, top, ids if wants and all(type(t) is int for t in ids) else ())


def generate_message(input_ids: list[int] | None, prompt: str | None, sampling_params: dict | None,
                     rid: str, stream: bool, messages: list[dict] | None, user: str = "") -> Generate:
    """The request as the router takes it; the prompt is exactly one of `input_ids`,
    `prompt` (text) or `messages` (a conversation). `user`: who it is for, among this
    connection's users (the router's second level of fairness; "" for the connection)."""
    if sum(p is not None for p in (input_ids, prompt, messages)) != 1:
        raise ValueError("give exactly one of input_ids, prompt or messages")
    chat = {"messages": list(messages)} if messages is not None else {}
    return Generate(rid, list(input_ids or []), dict(sampling_params or {}), stream,
                    text=prompt or "", chat=chat, user=user)


def chunk_of(part: TokenPart, asked: Asked = NOTHING) -> dict:
    """One request's share of a Tokens message as a chunk (see `Client.stream`).
    `asked`: what the request asked for, so that an abort the router made itself,
    which carries none, still has the keys, and the ids pair with their logprobs."""
    chunk = {"rid": part.rid, "token_ids": list(part.token_ids),
             "weight_versions": list(part.weight_versions), "finished": part.finished}
    if asked.logprobs or part.logprobs is not None:
        chunk["logprobs"] = list(part.logprobs or [])
    if asked.top or part.top_logprobs is not None:
        chunk["top_logprobs"] = [[list(pair) for pair in alternatives]
                                 for alternatives in part.top_logprobs or []]
    if asked.ids:
        chunk["token_ids_logprobs"] = [[[t, v] for t, v in zip(asked.ids, row)]
                                       for row in part.ids_logprobs or []]
    return chunk | (_final_fields(part) if part.finished else {})


def _final_fields(msg: TokenPart) -> dict:
    meta = dict(msg.meta)
    text = meta.pop("text", None)
    return {"finish_reason": msg.finish, "meta": meta, "text": text}


def assemble(chunks: list[dict]) -> dict:
    """One request's chunks, in order, as a finished response."""
    last = chunks[-1]
    meta = {k: v for k, v in last["meta"].items() if not k.startswith("input_")}
    out = {"rid": last["rid"], "output_ids": [t for c in chunks for t in c["token_ids"]],
           "weight_versions": [v for c in chunks for v in c["weight_versions"]],
           "finish_reason": last["finish_reason"], "meta": meta, "text": last["text"]}
    # the prompt's logprobs ride in the final meta; the response has them beside the
    # output's, as `zpd run`'s (engines.request.response)
    out |= {k: v for k, v in last["meta"].items() if k.startswith("input_")}
    for key, field in (("output_token_logprobs", "logprobs"), ("output_top_logprobs", "top_logprobs"),
                       ("output_token_ids_logprobs", "token_ids_logprobs")):
        if any(field in c for c in chunks):
            out[key] = [v for c in chunks for v in c.get(field, [])]
    return out
