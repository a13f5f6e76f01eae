"""Each client's share of the router: how many requests it may have routed to the
workers at once, and how many KV tokens they may hold. A request past either waits
its turn in the router's queue (zpd/router/admission.py) instead of taking pages
another client needs; only one that alone needs more tokens than a whole share is
refused (400), as it could never run.

A client is its identity on the router's front socket (one connection). Tokens are
the router's proxy for KV pages: a decode reserves pages for prompt +
max_new_tokens (pages = tokens / page_size) when it admits a request."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from zpd.wire.status import BAD_REQUEST
from zpd.limits import chat_bytes, utf8_len
from zpd.wire.protocol import Generate

# tokens a chat template may add (role markers, a default system prompt)
CHAT_TEMPLATE_ALLOWANCE = 1024


def request_tokens(msg: Generate) -> int:
    """prompt + max_new_tokens. The router has no tokenizer: a text is charged its UTF-8
    bytes, which no byte-level tokenizer's token count exceeds, and a conversation its
    JSON plus what a chat template may add around it. A request whose sampling the
    decode refused is charged its defaults' (the router refuses it before charging)."""
    prompt = len(msg.input_ids) or utf8_len(msg.text) or \
        (chat_bytes(msg.chat) + CHAT_TEMPLATE_ALLOWANCE if msg.chat else 0)
    return prompt + msg.sampling.max_new_tokens


@dataclass
class Share:
    """What one client holds: rid -> tokens charged, and its requests routed per user
    and per (user, call) (keys of `under`: (user,) and (user, call))."""
    rids: dict[str, int] = field(default_factory=dict)
    tokens: int = 0
    under: Counter = field(default_factory=Counter)
    path_of: dict[str, tuple[str, str]] = field(default_factory=dict)    # rid -> (user, call)


class ClientShares:
    """The router's charges, per client, for the requests it routed; every request
    charged must be released once, when the router forgets it (answered, or its
    routing failed)."""

    def __init__(self, max_requests: int, max_tokens: int) -> None:
        if max_requests < 1 or max_tokens < 1:
            raise ValueError("--max-client-requests and --max-client-tokens must be at least 1")
        self.max_requests, self.max_tokens = max_requests, max_tokens
        self.held: dict[bytes, Share] = {}
        self.owner: dict[str, bytes] = {}          # rid -> the client it is charged to

    def too_big(self, tokens: int) -> tuple[int, str] | None:
        """(400, why) for a request that alone needs more than a whole share."""
        if tokens <= self.max_tokens:
            return None
        return BAD_REQUEST, (f"the request needs {tokens} tokens of KV (prompt + "
                             f"max_new_tokens), more than one client may hold "
                             f"(--max-client-tokens {self.max_tokens})")

    def full(self, client: bytes) -> bool:
        """Has `client` as many requests routed as it may, whatever their size?"""
        share = self.held.get(client)
        return share is not None and len(share.rids) >= self.max_requests

    def fits(self, client: bytes, tokens: int) -> bool:
        """May `client` have one more request of `tokens` routed now?"""
        share = self.held.get(client)
        return share is None or (len(share.rids) < self.max_requests
                                 and share.tokens + tokens <= self.max_tokens)

    def take(self, client: bytes, rid: str, tokens: int, user: str = "", call: str = "") -> None:
        """Charge `rid` to `client` (the caller checked `fits`)."""
        self.release(rid)                          # a stale charge must not count twice
        share = self.held.setdefault(client, Share())
        share.rids[rid] = tokens
        share.tokens += tokens
        share.under[(user,)] += 1
        share.under[(user, call)] += 1
        share.path_of[rid] = (user, call)
        self.owner[rid] = client

    def routed(self, client: bytes, *path: str) -> int:
        """Requests `client` has routed now; with `path` (a user, or a user and one of
        its calls), that user's or call's."""
        share = self.held.get(client)
        if share is None:
            return 0
        return share.under.get(path, 0) if path else len(share.rids)

    def release(self, rid: str) -> None:
        """Give back `rid`'s charge (nothing if it has none)."""
        client = self.owner.pop(rid, None)
        if client is None:
            return
        share = self.held[client]
        share.tokens -= share.rids.pop(rid)
        user, call = share.path_of.pop(rid)
        for key in ((user,), (user, call)):
            share.under[key] -= 1
            if not share.under[key]:
                del share.under[key]
        if not share.rids:
            del self.held[client]
