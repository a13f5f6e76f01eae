"""`zpd.Client`: submit requests, stream tokens and send admin commands to a router
(or admin commands straight to one worker), or to several routers: zpd/failover.py
says which router takes each request and what happens when one dies."""
from __future__ import annotations

import time
import uuid
import weakref
from collections import deque
from typing import Iterator, NamedTuple, Sequence

import zmq

from engines.sampling_params import SamplingParams
from zpd.client_links import Links
from zpd.failover import FANNED, PEER_WAIT_S, Routers, merge_replies, parse_routers
from zpd.wire.net import Curve
from zpd.wire.protocol import (Abort, Accepted, Admin, AdminReply, Generate, Message, Rows,
                               TokenPart, Tokens)
from zpd.wire.rows import RowsInbox


# A request's sampling parameters: the record, or a dict of its fields (None: defaults).
Sampling = SamplingParams | dict | None


class NoAnswerError(TimeoutError):
    """A request was not acknowledged within the client's `connect_timeout`: nothing
    listens at the address, or what listens there is not a zpd router."""


class Client:
    """One DEALER connection per router; not thread-safe (use one Client per thread)."""

    def __init__(self, endpoint: str | Sequence[str], timeout: float = 300.0,
                 curve: Curve | None = None, connect_timeout: float = 5.0,
                 router_silence: float = 10.0) -> None:
        """`endpoint`: "host:port", or several routers as "h:p,h:p" or a list.
        `timeout`: seconds to wait for each answer. `connect_timeout`: seconds within
        which the router must acknowledge each request submitted, else the request goes
        to the next router up, or with none NoAnswerError (a TimeoutError), so a wrong
        address fails fast. `router_silence`: a router silent this long with requests in
        flight is gone; they end with 503, as when its connection drops. `curve`: this
        client's CURVE keys (`zpd.wire.security.client_curve`) for a cluster started
        with --curve-keys; None speaks plaintext."""
        self.routers = Routers(parse_routers(endpoint))
        self.endpoint = ",".join(self.routers.endpoints)
        self.timeout, self.connect_timeout = timeout, connect_timeout
        self.router_silence = router_silence
        self._ctx = zmq.Context()
        try:
            self._links = Links(self._ctx, self.routers.endpoints, curve)
        except BaseException:
            self._ctx.destroy(linger=0)
            raise
        self._owner: dict[str, int] = {}            # rid -> the router that has it
        self._sent: dict[str, tuple[Generate, set[int]]] = {}   # unacknowledged: msg, tried
        # Also runs if the Client is dropped unclosed: a context left to the garbage
        # collector may be finalized before its socket and then wait on it forever.
        self._closer = weakref.finalize(self, _shut, self._links, self._ctx)
        self._closer.atexit = False   # at exit a daemon thread may still be reading
        self._parts: deque[TokenPart] = deque()     # the rest of a batched `Tokens` message
        self._rows = RowsInbox()                    # routed experts ahead of their final part
        self._unacked: dict[str, float] = {}        # rid -> when its acknowledgement is due
        self._asked: dict[str, Asked] = {}          # rid -> the logprobs it asked for

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
                 sampling_params: Sampling = None, rid: str | None = None,
                 messages: list[dict] | None = None) -> dict:
        """Run one request to the end; returns the response dict (docs/design.md, "Python client").
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
               sampling_params: Sampling = None, rid: str | None = None,
               stream: bool = False, messages: list[dict] | None = None) -> str:
        """Send a request without waiting; returns its rid. Read answers with `receive`."""
        return self._submit(input_ids, prompt, sampling_params, rid, stream, messages)

    def receive(self, timeout: float | None = None) -> dict:
        """The next chunk for any submitted request (see `stream` for its fields)."""
        return self._chunk(self._next(TokenPart, "a token", timeout))

    def stream(self, input_ids: list[int] | None = None, prompt: str | None = None,
               sampling_params: Sampling = None, rid: str | None = None,
               messages: list[dict] | None = None) -> Iterator[dict]:
        """Yield chunks {rid, token_ids, weight_versions, finished} as tokens are made; the
        last chunk also has finish_reason, meta and text. A request that asked for
        logprobs (`return_logprob`) has "logprobs" in every chunk, one per token id, and
        one that asked for `top_logprobs_num` N also "top_logprobs", per token its N most
        likely [token_id, logprob] pairs, highest first, and one that asked for
        `token_ids_logprob` also "token_ids_logprobs", per token those ids' [token_id,
        logprob] pairs in the order asked; with `logprob_start_len` the
        last chunk's meta has the prompt's (input_*) too (docs/serving.md, "Logprobs"). With
        `return_routed_experts` (a mixture of experts, workers started with
        --enable-return-routed-experts) the last chunk's meta has "routed_experts", and
        with `return_routed_expert_weights` "routed_expert_weights" (engines/routed.py).
        Closing the iterator early aborts the request (499)."""
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
        return chunk_of(self._rows.finish(msg), asked)

    def abort(self, rid: str, reason: str = "aborted by client") -> None:
        i = self._owner.get(rid, 0)
        self._links.resumes[i].closed(rid)
        self._links.send(i, Abort(rid, 499, reason))

    def _submit(self, input_ids: list[int] | None = None, prompt: str | None = None,
                sampling_params: Sampling = None, rid: str | None = None,
                stream: bool = False, messages: list[dict] | None = None) -> str:
        rid, refused = rid or uuid.uuid4().hex, ""
        try:
            params = sampling_record(sampling_params)
        except ValueError as e:
            params, refused = SamplingParams(), str(e)
        msg = generate_message(input_ids, prompt, params, rid, stream, messages)
        if refused:                          # refused here, answered as the router would
            self._parts.append(TokenPart.abort(rid, 400, refused))
            return rid
        asked = asks_logprobs(msg.sampling)
        if asked != NOTHING:
            self._asked[msg.rid] = asked
        self._send_to(self.routers.pick(time.monotonic()), msg, set())
        return msg.rid

    def _send_to(self, i: int, msg: Generate, tried: set[int]) -> None:
        now = time.monotonic()
        if msg.rid in self._owner:                  # moved: its last router is gone
            self._links.resumes[self._owner[msg.rid]].closed(msg.rid)
        self._links.resumes[i].opened(msg.rid, now)
        self._links.send(i, msg)
        tried.add(i)
        self._owner[msg.rid], self._sent[msg.rid] = i, (msg, tried)
        self._unacked[msg.rid] = now + self.connect_timeout
        self._links.heard[i] = max(self._links.heard[i], now)     # silence counts from here

    # --- admin ----------------------------------------------------------------------

    def admin(self, command: str, timeout: float | None = None, **args) -> dict:
        """Send an admin command; returns {"ok": bool, **result}. `timeout` bounds the
        whole call (TimeoutError after it)."""
        now, wait = time.monotonic(), timeout or self.timeout
        targets = self.routers.fanned(now) if command in FANNED else \
            [self.routers.coordinator(now)]
        asked: dict[str, tuple[int, float]] = {}    # req_id -> its router, when it is due
        for k, i in enumerate(targets):
            share = wait if k == 0 else min(wait, PEER_WAIT_S)
            # A router answers with what it has (missing workers marked 504) a little
            # before we give up, so one dead worker still yields the others' results.
            timed = args | {"timeout": share * 0.8} if timeout is not None or k else args
            req_id = uuid.uuid4().hex
            self._links.send(i, Admin(command, timed, req_id))
            asked[req_id] = (i, now + share)
        replies: dict[str, dict] = {}
        while due := [d for r, (_, d) in asked.items()
                      if r not in replies and d > time.monotonic()]:
            try:
                msg = self._next(AdminReply, f"the {command!r} reply",
                                 max(min(due) - time.monotonic(), 1e-3))
            except NoAnswerError:
                raise
            except TimeoutError:
                continue
            if msg.req_id in asked:
                replies[msg.req_id] = {"ok": msg.ok} | msg.result
        if not replies:
            raise TimeoutError(f"no answer from {self.endpoint} within {wait:.0f} s while "
                               f"waiting for the {command!r} reply")
        return merge_replies(command, [replies.get(r) or self._silent(i)
                                       for r, (i, _) in asked.items()])

    def _silent(self, i: int) -> dict:
        endpoint = self._links.endpoint(i)
        return {"ok": False, "status": 504, "router": endpoint,
                "error": f"no answer from the router {endpoint} in time"}

    def _next(self, kind: type, what: str, timeout: float | None = None) -> Message | TokenPart:
        """The next `kind` (a message type, or TokenPart for one request's tokens);
        acknowledgements are taken on the way and never returned."""
        deadline = time.monotonic() + (timeout or self.timeout)
        while True:
            if kind is TokenPart and self._parts:       # the rest of a batch, or a 503 here
                return self._parts.popleft()
            now = time.monotonic()
            got = self._recv(max(0.0, min(deadline - now, self._ack_wait(now),
                                          self._links.probe_wait(now))))
            msg = self._take(*got, kind) if got is not None else None
            if msg is not None:
                return msg
            if got is None:                 # nothing pending: is anything overdue?
                now = time.monotonic()
                self._links.probe(now)
                self._check_silent(now)
                self._check_acked(now)
                if now >= deadline:
                    raise TimeoutError(f"no answer from {self.endpoint} within "
                                       f"{timeout or self.timeout:.0f} s while waiting for {what}")

    def _recv(self, timeout: float) -> tuple[int, Message] | None:
        """The next message and the router it came from; None after `timeout` seconds,
        or after connection events (a dropped router's requests handled then)."""
        got, events = self._links.poll(timeout)
        if got is not None:
            self.routers.heard(got[0])
        for i, event in events:
            if self.routers.link_event(i, event):       # what it never acknowledged moves
                self._move(i, [rid for rid, owner in self._owner.items()
                               if owner == i and rid in self._sent])
        return got

    def _take(self, i: int, msg: Message, kind: type) -> Message | TokenPart | None:
        """Note what `msg` from router `i` tells; return it (or its first part) if it is
        a `kind`. A late answer of a router a request was moved away from is dropped."""
        resumes = self._links.resumes[i]
        for resume in resumes.note(msg, time.monotonic()):     # the router restarted
            self._links.send(i, resume)
        if isinstance(msg, Accepted):
            for rid in msg.rids:
                if self._owner.get(rid) == i:
                    self._acked(rid)
        elif isinstance(msg, Tokens):            # several requests' tokens at once
            for got in msg.unpack():
                if self._owner.get(got.rid, i) != i:
                    continue
                self._acked(got.rid)             # an answer implies the request arrived
                part = resumes.got(got)          # what this client has not had
                if part is None:
                    continue
                if part.finished:
                    self._owner.pop(part.rid, None)
                self._parts.append(part)
            if kind is TokenPart and self._parts:
                return self._parts.popleft()
        elif isinstance(msg, Rows):              # a request's routed experts, before its end
            if self._owner.get(msg.rid) == i:
                self._rows.take(msg)
        elif isinstance(msg, kind):
            return msg
        return None

    def _acked(self, rid: str) -> None:
        self._unacked.pop(rid, None)
        self._sent.pop(rid, None)

    def _move(self, i: int, rids: list[str]) -> None:
        """Send `rids`, which router `i` never acknowledged, to another router up (else
        they wait out their acknowledgement)."""
        for rid in rids:
            msg, tried = self._sent[rid]
            j = self.routers.next_up(time.monotonic(), tried)
            if j is not None:
                self._send_to(j, msg, tried)

    def _lost(self, i: int, why: str) -> None:
        """Router `i` is silent: what it never acknowledged goes to another router up;
        the rest ends now with 503."""
        mine = [rid for rid, owner in self._owner.items() if owner == i]
        self._move(i, [rid for rid in mine if rid in self._sent])
        for rid in mine:
            if rid not in self._sent:
                del self._owner[rid]
                self._links.resumes[i].closed(rid)
                self._parts.append(TokenPart.abort(rid, 503, why))

    def _check_silent(self, now: float) -> None:
        """Routers silent past router_silence with requests in flight are gone (a
        router pings every client with requests in flight)."""
        for i in set(self._owner.values()):
            silent = now - self._links.heard[i]
            if silent > self.router_silence:
                self.routers.down(i, now)
                self._lost(i, f"the router {self._links.endpoint(i)} has not answered "
                              f"for {silent:.0f} s")
                self._links.heard[i] = now

    def _ack_wait(self, now: float) -> float:
        """Seconds until the next acknowledgement is due, or a router with requests in
        flight has been silent too long (a long time if neither can be)."""
        due = min(self._unacked.values(), default=now + self.timeout)
        busy = set(self._owner.values())
        return min([due] + [self._links.heard[i] + self.router_silence for i in busy]) - now

    def _check_acked(self, now: float) -> None:
        """Raise NoAnswerError for requests whose acknowledgement is overdue (forgotten
        then, so a later call waits as usual)."""
        late = [rid for rid, due in self._unacked.items() if due <= now]
        failed = []
        for rid in late:
            i = self._owner[rid]
            self.routers.down(i, now)
            self.abort(rid, "not acknowledged in time")      # in case it arrives late
            msg, tried = self._sent[rid]
            j = self.routers.next_up(now, tried)
            if j is not None:
                self._send_to(j, msg, tried)
                continue
            del self._unacked[rid], self._sent[rid], self._owner[rid]
            self._links.resumes[i].closed(rid)
            failed.append(self._links.endpoint(i))
        if failed:
            raise NoAnswerError(f"no answer from router {','.join(sorted(set(failed)))} within "
                                f"{self.connect_timeout:g} s: is a router running there?")


def _shut(links: Links, ctx: zmq.Context) -> None:
    # linger 0 throughout: term() would otherwise wait for any socket still open
    links.close()
    ctx.destroy(linger=0)


class Asked(NamedTuple):
    """The output logprobs a request asked for: each token's, its top alternatives, and
    those of the token_ids_logprob ids (which the answer pairs with its values)."""
    logprobs: bool = False
    top: bool = False
    ids: tuple[int, ...] = ()


NOTHING = Asked()


def asks_logprobs(params: SamplingParams) -> Asked:
    """The output logprobs as the sampling parameters ask for them."""
    return Asked(params.wants_logprobs, params.top_logprobs_num > 0, params.output_ids_logprob)


def sampling_record(sampling: Sampling) -> SamplingParams:
    """`sampling` as the record (a dict is checked here: ValueError names a bad value)."""
    return sampling if isinstance(sampling, SamplingParams) else SamplingParams.from_dict(sampling)


def generate_message(input_ids: list[int] | None, prompt: str | None, sampling: SamplingParams,
                     rid: str, stream: bool, messages: list[dict] | None, user: str = "",
                     call: str = "", chat_extra: dict | None = None) -> Generate:
    """The request as the router takes it; the prompt is exactly one of `input_ids`,
    `prompt` (text) or `messages` (a conversation, with `chat_extra`'s "tools" and
    "chat_template_kwargs" for the template). `user`: who it is for, among this
    connection's users (the router's second level of fairness; "" for the connection);
    `call`: which of that user's calls (the third level)."""
    if sum(p is not None for p in (input_ids, prompt, messages)) != 1:
        raise ValueError("give exactly one of input_ids, prompt or messages")
    chat = {"messages": list(messages)} | (chat_extra or {}) if messages is not None else {}
    return Generate(rid, list(input_ids or []), sampling, stream,
                    text=prompt or "", chat=chat, user=user, call=call)


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
