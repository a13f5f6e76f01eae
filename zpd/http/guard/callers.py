"""Who an HTTP request comes from, and what that caller may learn of others.

The key a request presents makes its caller: "admin" (--admin-api-key), "user"
(--api-key) or "anon" (none). `CallerBackend` wraps the router client and keeps
callers apart where the router would not:

- Rids: the router refuses a rid already in flight (409) from any client, so a caller
  could probe for another's rids. Every rid a caller names reaches the router as
  "<key>.<hash of its address and key>:<rid>" and comes back as it was given;
  /abort_request (an admin route) still finds a rid in every caller's space.
- Addresses: only a caller with the admin routes' rights sees where the router and
  workers listen (without --curve-keys, anyone who knows them can talk to them
  directly). Everyone else sees each worker as its role and index ("decode0"), in the
  router's status and in every message that would name an address.

The caller travels in a context variable, set by the key check for the handler's task,
because the routes hand requests to the backend without the HTTP request."""
from __future__ import annotations

import hashlib
import hmac
import re
from collections import Counter
from contextvars import ContextVar
from dataclasses import dataclass, replace
from typing import Any, Callable

from zpd.http.records import GenRequest
from zpd.http.router_client import USER
from zpd.http.streams import Backend

NOT_FOUND = 404
# host:port of an address (a version string such as "1.2.3.4" has no port)
ADDRESS = re.compile(r"(?:\[[0-9a-fA-F:.%\w]+\]|\b\d{1,3}(?:\.\d{1,3}){3}|\blocalhost):\d+")
HIDDEN = "[address]"


@dataclass(frozen=True)
class Caller:
    """Who sent a request: the key it presented, and whether it may see addresses."""
    tag: str                # "admin", "user" or "anon"
    sees_internals: bool


HIDDEN_FROM = Caller("anon", False)   # the default: outside a checked request, hide
CALLER: ContextVar[Caller] = ContextVar("zpd_http_caller", default=HIDDEN_FROM)


def caller_of(token: bytes, api_key: str | None, admin_key: str | None) -> Caller:
    """The caller a request's (already checked) Bearer `token` makes. The admin routes'
    rights, and with them the addresses, go with the admin key, or with passing the
    key check at all where there is no admin key."""
    if admin_key and hmac.compare_digest(token, admin_key.encode()):
        return Caller("admin", True)
    if api_key and hmac.compare_digest(token, api_key.encode()):
        return Caller("user", admin_key is None)
    return Caller("anon", admin_key is None and api_key is None)


def space(caller: Caller) -> str:
    """The rid space of the current caller: its key, and its address as the router's
    fair queue names it (USER), hashed (the router's logs show this prefix)."""
    user = USER.get()
    return f"{caller.tag}.{hashlib.sha256(user.encode()).hexdigest()[:8]}" if user else caller.tag


class CallerBackend:
    """The router client as the current caller (CALLER) should see it."""

    def __init__(self, inner: Backend, router: str = "") -> None:
        self.inner, self.router = inner, router
        self.inflight: dict[str, Counter] = {}    # a rid as given -> the router's, open count
        self.names: dict[str, str] = {}                # address -> role and index

    def open(self, req: GenRequest, sink: Callable[[dict], None], *args, **kw) -> Callable[[], None]:
        caller = CALLER.get()
        if req.rid is None:
            return self.inner.open(req, self._shown(sink, caller, None, None), *args, **kw)
        given, ours = req.rid, f"{space(caller)}:{req.rid}"
        spaces = self.inflight.setdefault(given, Counter())
        spaces[ours] += 1
        done = []

        def forget() -> None:                  # once per open, at its end or its close
            if not done:
                done.append(True)
                spaces[ours] -= 1
                if spaces[ours] <= 0:
                    del spaces[ours]
                if not spaces and self.inflight.get(given) is spaces:
                    del self.inflight[given]
        try:
            close = self.inner.open(replace(req, rid=ours), self._shown(sink, caller, ours,
                                                                         given, forget), *args, **kw)
        except BaseException:
            forget()
            raise

        def closed() -> None:
            forget()
            close()
        return closed

    def _shown(self, sink, caller: Caller, ours: str | None, given: str | None,
               forget: Callable[[], None] | None = None) -> Callable[[dict], None]:
        """`sink`, handed each chunk with the rid as the caller gave it and, for a caller
        who may not see them, no addresses in its messages."""
        def show(chunk: dict) -> None:
            if ours is not None and chunk.get("rid") == ours:
                chunk = chunk | {"rid": given}
            if not chunk.get("finished"):           # most: tokens alone
                return sink(chunk)
            finish = chunk.get("finish_reason")
            if isinstance(finish, dict) and isinstance(finish.get("message"), str):
                text = finish["message"].replace(ours, given) if ours else finish["message"]
                chunk = chunk | {"finish_reason": finish | {"message": self._hide(text, caller)}}
            if chunk.get("finished") and forget is not None:
                forget()
            sink(chunk)
        return show

    async def admin(self, command: str, timeout: float | None = None, **args) -> dict:
        caller = CALLER.get()
        if command == "abort" and isinstance(args.get("rid"), str):
            return await self._abort(args["rid"], timeout)
        reply = await self.inner.admin(command, timeout, **args)
        if command == "status" and isinstance(reply, dict):
            self._learn(reply)
        return reply if caller.sees_internals else self._redacted(reply)

    async def _abort(self, rid: str, timeout: float | None) -> dict:
        """Abort `rid` in every caller's space (or as the router knows it)."""
        replies = [await self.inner.admin("abort", timeout, rid=r)
                   for r in sorted(self.inflight.get(rid, ())) or [rid]]
        return next((r for r in replies if r.get("ok")), replies[-1])

    def _learn(self, reply: dict) -> None:
        """Name each worker of a status reply by its role and index among that role."""
        counts: dict[str, int] = {}
        for w in reply.get("workers") or ():
            if isinstance(w, dict) and isinstance(w.get("endpoint"), str):
                role = str(w.get("role") or "worker")
                self.names[w["endpoint"]] = f"{role}{counts.get(role, 0)}"
                counts[role] = counts.get(role, 0) + 1

    def _redacted(self, obj: Any) -> Any:
        if isinstance(obj, dict):
            return {k: self._redacted(v) for k, v in obj.items()}
        if isinstance(obj, list):
            return [self._redacted(v) for v in obj]
        return self._hide(obj, HIDDEN_FROM) if isinstance(obj, str) else obj

    def _hide(self, text: str, caller: Caller) -> str:
        if caller.sees_internals:
            return text
        for address, name in self.names.items():
            text = text.replace(address, name)
        for router in filter(None, self.router.split(",")):
            text = text.replace(router, "the router")
        return ADDRESS.sub(HIDDEN, text)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)        # start, close, ... of the router client

