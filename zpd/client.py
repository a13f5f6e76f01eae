"""`zpd.Client`: submit requests, stream tokens and send admin commands to a router
(or admin commands straight to one worker)."""
from __future__ import annotations

import time
import uuid
from typing import Iterator

import zmq

from zpd.net import Dealer
from zpd.protocol import Abort, Admin, AdminReply, Generate, Message, Token


class Client:
    """One DEALER connection; not thread-safe (use one Client per thread)."""

    def __init__(self, endpoint: str, timeout: float = 300.0) -> None:
        self.endpoint, self.timeout = endpoint, timeout
        self._ctx = zmq.Context()
        self._dealer = Dealer(self._ctx, endpoint)

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
        rids = [self._submit(stream=False, **r) for r in requests]
        parts: dict[str, list[Token]] = {rid: [] for rid in rids}
        done: dict[str, dict] = {}
        while len(done) < len(rids):
            msg = self._next(Token, "a token")
            if msg.rid in parts and msg.rid not in done:
                parts[msg.rid].append(msg)
                if msg.finished:
                    done[msg.rid] = _assemble(parts[msg.rid])
        return [done[rid] for rid in rids]

    def stream(self, input_ids: list[int] | None = None, prompt: str | None = None,
               sampling_params: dict | None = None, rid: str | None = None) -> Iterator[dict]:
        """Yield chunks {rid, token_ids, weight_versions, finished} as tokens are made; the
        last chunk also has finish_reason, meta and text. Closing the iterator early
        aborts the request (499)."""
        rid = self._submit(input_ids, prompt, sampling_params, rid, True)
        finished = False
        try:
            while not finished:
                msg = self._next(Token, "a token")
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
        """Send an admin command; returns {"ok": bool, **result}."""
        req_id = uuid.uuid4().hex
        if timeout is not None:
            args["timeout"] = timeout
        self._dealer.send(Admin(command, args, req_id))
        wait = (timeout or self.timeout) + 5.0
        while True:
            msg = self._next(AdminReply, f"the {command!r} reply", wait)
            if msg.req_id == req_id:
                return {"ok": msg.ok} | msg.result

    def _next(self, kind: type[Message], what: str, timeout: float | None = None) -> Message:
        deadline = time.monotonic() + (timeout or self.timeout)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no answer from {self.endpoint} within "
                                   f"{timeout or self.timeout:.0f} s while waiting for {what}")
            msg = self._dealer.recv(timeout=left)
            if isinstance(msg, kind):
                return msg


def _final_fields(msg: Token) -> dict:
    meta = dict(msg.meta)
    text = meta.pop("text", None)
    return {"finish_reason": msg.finish, "meta": meta, "text": text}


def _assemble(parts: list[Token]) -> dict:
    last = parts[-1]
    return {"rid": last.rid, "output_ids": [t for p in parts for t in p.token_ids],
            "weight_versions": [v for p in parts for v in p.weight_versions]} | _final_fields(last)
