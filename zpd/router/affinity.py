"""Cache-aware routing: requests that begin alike go to the prefill that computed
that beginning last, where its prefix cache has it, unless that prefill is much
busier than the least loaded one (then load wins, and the new one is remembered).

A prompt's beginning is its first AFFINITY_TOKENS token ids (a text prompt: its first
AFFINITY_CHARS characters; a chat: its first message), enough to tell GRPO's samples
of one prompt, or one conversation's turns, from other prompts."""
from __future__ import annotations

import hashlib
import random
from array import array
from collections import OrderedDict
from typing import TYPE_CHECKING, Sequence

import orjson

if TYPE_CHECKING:
    from zpd.router.server import Worker
    from zpd.wire.protocol import Generate

AFFINITY_TOKENS = 32          # two pages of the default page size
AFFINITY_CHARS = 256
MAX_ENTRIES = 1 << 16


def prefix_key(msg: "Generate") -> bytes | None:
    if msg.input_ids:
        raw = b"i" + array("q", msg.input_ids[:AFFINITY_TOKENS]).tobytes()
    elif msg.text:
        raw = b"t" + msg.text[:AFFINITY_CHARS].encode("utf-8", "replace")
    elif msg.chat:
        messages = msg.chat.get("messages") if isinstance(msg.chat, dict) else None
        raw = b"c" + orjson.dumps(messages[:1] if isinstance(messages, list) else None)
    else:
        return None
    return hashlib.blake2b(raw, digest_size=16).digest()


class PrefixAffinity:
    def __init__(self, max_entries: int = MAX_ENTRIES) -> None:
        self.last: OrderedDict[bytes, str] = OrderedDict()     # prefix key -> prefill endpoint
        self.max_entries = max_entries

    def pick(self, msg: "Generate", candidates: Sequence["Worker"]) -> "Worker":
        """The prefill for `msg` among live `candidates` (not empty)."""
        key = prefix_key(msg)
        least = min(w.load for w in candidates)
        if key is not None and key in self.last:
            warm = next((w for w in candidates if w.endpoint == self.last[key]), None)
            if warm is not None and warm.load <= 2 * least + 2:
                self.last.move_to_end(key)
                return warm
        chosen = random.choice([w for w in candidates if w.load == least])
        if key is not None:
            self.last[key] = chosen.endpoint
            self.last.move_to_end(key)
            if len(self.last) > self.max_entries:
                self.last.popitem(last=False)
        return chosen
