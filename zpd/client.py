"""`zpd.Client`: submit requests, stream tokens and send admin commands to a router
(or admin commands straight to one worker)."""
from __future__ import annotations

import time
import uuid
from collections import deque
from typing import Iterator

import zmq

from zpd.wire.net import Curve, Dealer, SocketOptions
from zpd.wire.protocol import Abort, Admin, AdminReply, Generate, Message, TokenPart, Tokens


class Client:
    """One DEALER connection; not thread-safe (use one Client per thread)."""

    def __init__(self, endpoint: str, timeout: float = 300.0, curve: Curve | None = None) -> None:
        """`curve`: this client's CURVE keys (`zpd.wire.security.client_curve`) for a cluster
        started with --curve-keys; None speaks plaintext."""
        self.endpoint, self.timeout = endpoint, timeout
        self._ctx = zmq.Context()
        self._dealer = Dealer(self._ctx, endpoint, opts=SocketOptions(curve=curve))
        self._parts: deque[TokenPart] = deque()     # the rest of a batched `Tokens` message

    def close(self) -> None:
        self._dealer.close()
        self._ctx.term()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- generation ---------------------------------------------------------------

    def generate(self, input_ids: list[int] | None = None, prompt: str | None = None,
                 sampling_params: dict | None = None, rid: str | None = None) -> dict:
        """Run one request to the end; returns the response dict (DESIGN.md contract)."""
        return self.generate_many([{"input_ids": input_ids, "prompt": prompt,
                                    "sampling_params": sampling_params, "rid": rid}])[0]

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
               stream: bool = False) -> str:
        """Send a request without waiting; returns its rid. Read answers with `receive`."""
        return self._submit(input_ids, prompt, sampling_params, rid, stream)

    def receive(self, timeout: float | None = None) -> dict:
        """The next chunk for any submitted request (see `stream` for its fields)."""
        msg = self._next(TokenPart, "a token", timeout)
        chunk = {"rid": msg.rid, "token_ids": list(msg.token_ids),
                 "weight_versions": list(msg.weight_versions), "finished": msg.finished}
        return chunk | (_final_fields(msg) if msg.finished else {})

    def stream(self, input_ids: list[int] | None = None, prompt: str | None = None,
               sampling_params: dict | None = None, rid: str | None = None) -> Iterator[dict]:
        """Yield chunks {rid, token_ids, weight_versions, finished} as tokens are made; the
        last chunk also has finish_reason, meta and text. Closing the iterator early
        aborts the request (499)."""
        rid = self._submit(input_ids, prompt, sampling_params, rid, True)
        finished = False
        try:
            while not finished:
                msg = self._next(TokenPart, "a token")
                if msg.rid != rid:
                    continue
                finished = msg.finished
                chunk = {"rid": rid, "token_ids": list(msg.token_ids),
                         "weight_versions": list(msg.weight_versions), "finished": finished}
                if finished:
                    chunk |= _final_fields(msg)
                yield chunk
        finally:
            if not finished:
                self.abort(rid, "client closed the stream")

    def abort(self, rid: str, reason: str = "aborted by client") -> None:
        self._dealer.send(Abort(rid, 499, reason))

    def _submit(self, input_ids: list[int] | None = None, prompt: str | None = None,
                sampling_params: dict | None = None, rid: str | None = None,
                stream: bool = False) -> str:
        if (input_ids is None) == (prompt is None):
            raise ValueError("give exactly one of input_ids or prompt")
        rid = rid or uuid.uuid4().hex
        self._dealer.send(Generate(rid, list(input_ids or []), dict(sampling_params or {}), stream,
                                   text=prompt or ""))
        return rid

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
        """The next `kind`: a message type, or TokenPart for one request's tokens."""
        if kind is TokenPart and self._parts:
            return self._parts.popleft()
        deadline = time.monotonic() + (timeout or self.timeout)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no answer from {self.endpoint} within "
                                   f"{timeout or self.timeout:.0f} s while waiting for {what}")
            msg = self._dealer.recv(timeout=left)
            if isinstance(msg, Tokens):            # several requests' tokens at once
                self._parts.extend(msg.unpack())
                if kind is TokenPart and self._parts:
                    return self._parts.popleft()
            elif isinstance(msg, kind):
                return msg


def _final_fields(msg: TokenPart) -> dict:
    meta = dict(msg.meta)
    text = meta.pop("text", None)
    return {"finish_reason": msg.finish, "meta": meta, "text": text}


def assemble(chunks: list[dict]) -> dict:
    """One request's chunks, in order, as a finished response."""
    last = chunks[-1]
    return {"rid": last["rid"], "output_ids": [t for c in chunks for t in c["token_ids"]],
            "weight_versions": [v for c in chunks for v in c["weight_versions"]],
            "finish_reason": last["finish_reason"], "meta": last["meta"], "text": last["text"]}
