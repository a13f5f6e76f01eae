"""Each client's share of the router: how many requests it may have in flight or
queued, and how many KV tokens they may hold. Past either, a request is answered
at once (503, "busy: ...") instead of waiting for pages another client holds.

A client is its identity on the router's front socket (one connection). Tokens are
the router's proxy for KV pages: a decode reserves pages for prompt +
max_new_tokens (pages = tokens / page_size) when it admits a request."""
from __future__ import annotations

from dataclasses import dataclass, field

from engines.request import BAD_REQUEST, UNAVAILABLE
from engines.sampler import SamplingParams
from zpd.config import chat_bytes, default_of, utf8_len
from zpd.wire.protocol import Generate

DEFAULT_MAX_NEW = default_of(SamplingParams, "max_new_tokens")
# tokens a chat template may add (role markers, a default system prompt)
CHAT_TEMPLATE_ALLOWANCE = 1024


def request_tokens(msg: Generate) -> int:
    """prompt + max_new_tokens. The router has no tokenizer: a text is charged its UTF-8
    bytes, which no byte-level tokenizer's token count exceeds, and a conversation its
    JSON plus what a chat template may add around it. A bad max_new_tokens is
    charged the default; the workers refuse it anyway."""
    prompt = len(msg.input_ids) or utf8_len(msg.text) or \
        (chat_bytes(msg.chat) + CHAT_TEMPLATE_ALLOWANCE if msg.chat else 0)
    new = msg.sampling.get("max_new_tokens")
    return prompt + (new if type(new) is int and new > 0 else DEFAULT_MAX_NEW)


@dataclass
class Share:
    """What one client holds: rid -> tokens charged."""
    rids: dict[str, int] = field(default_factory=dict)
    tokens: int = 0


class ClientShares:
    """The router's charges, per client; every request charged must be released once,
    when the router forgets it (answered, refused after queueing, or never routed)."""

    def __init__(self, max_requests: int, max_tokens: int) -> None:
        if max_requests < 1 or max_tokens < 1:
            raise ValueError("--max-client-requests and --max-client-tokens must be at least 1")
        self.max_requests, self.max_tokens = max_requests, max_tokens
        self.held: dict[bytes, Share] = {}
        self.owner: dict[str, bytes] = {}          # rid -> the client it is charged to

    def take(self, client: bytes, rid: str, tokens: int) -> tuple[int, str] | None:
        """Charge `rid` to `client`; or (status, message) if it may not run now."""
        if tokens > self.max_tokens:
            return BAD_REQUEST, (f"the request needs {tokens} tokens of KV (prompt + "
                                 f"max_new_tokens), more than one client may hold "
                                 f"(--max-client-tokens {self.max_tokens})")
        share = self.held.get(client) or Share()
        if len(share.rids) >= self.max_requests:
            return UNAVAILABLE, (f"busy: this client has {len(share.rids)} requests in flight, "
                                 f"its share (--max-client-requests {self.max_requests})")
        if share.tokens + tokens > self.max_tokens:
            return UNAVAILABLE, (f"busy: this client's requests hold {share.tokens} tokens of "
                                 f"KV and this one needs {tokens}; its share is "
                                 f"{self.max_tokens} (--max-client-tokens)")
        self.release(rid)                          # a stale charge must not count twice
        share.rids[rid] = tokens
        share.tokens += tokens
        self.held[client], self.owner[rid] = share, client
        return None

    def release(self, rid: str) -> None:
        """Give back `rid`'s charge (nothing if it has none)."""
        client = self.owner.pop(rid, None)
        if client is None:
            return
        share = self.held[client]
        share.tokens -= share.rids.pop(rid)
        if not share.rids:
            del self.held[client]
