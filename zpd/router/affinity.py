"""Cache-aware routing: a request goes to the prefill that last computed most of its
prompt, where that prefill's prefix cache likely still holds it, unless that prefill
is much busier than the least loaded one; otherwise to the least loaded.

The router remembers, for each 16-token page of the prompts it routed (a hash chain,
as the workers' caches key them, without the weight version), the prefill it chose;
a new prompt's longest remembered chain says where its prefix was computed. That
serves GRPO's samples of one prompt (all of it matches) and a conversation's next
turn (the previous prompt is its prefix). Text and chat prompts, whose token ids the
router does not see, match only when their text (or first message) is the same."""
from __future__ import annotations

import hashlib
import random
from array import array
from collections import OrderedDict
from typing import TYPE_CHECKING, Sequence

import orjson

if TYPE_CHECKING:
    from zpd.router.flights import Worker
    from zpd.wire.protocol import Generate

PAGE = 16                   # tokens per remembered page (the workers' default page size)
MAX_PAGES = 64              # pages of one prompt remembered (the first 1,024 tokens)
MIN_SHARE = 0.5             # follow a remembered prefix only if it is this much of the prompt
SLACK = 16                  # ... and its prefill has at most 2 * least + SLACK requests
MAX_ENTRIES = 1 << 18


def prompt_keys(msg: "Generate") -> tuple[list[bytes], int]:
    """The hash chain of the prompt's pages (the last one may be partial), and how
    many tokens each key covers (for the share matched)."""
    if msg.input_ids:
        ids = msg.input_ids[:PAGE * MAX_PAGES]
        keys, prev = [], b"i"
        for start in range(0, len(ids), PAGE):
            prev = hashlib.blake2b(prev + array("q", ids[start:start + PAGE]).tobytes(),
                                   digest_size=16).digest()
            keys.append(prev)
        return keys, PAGE
    if msg.text:
        raw = b"t" + msg.text.encode("utf-8", "replace")
    elif isinstance(msg.chat, dict) and isinstance(msg.chat.get("messages"), list):
        raw = b"c" + orjson.dumps(msg.chat["messages"][:1])
    else:
        return [], PAGE
    return [hashlib.blake2b(raw, digest_size=16).digest()], 0


class PrefixAffinity:
    def __init__(self, max_entries: int = MAX_ENTRIES) -> None:
        self.last: OrderedDict[bytes, str] = OrderedDict()     # page key -> prefill endpoint
        self.max_entries = max_entries

    def pick(self, msg: "Generate", candidates: Sequence["Worker"]) -> "Worker":
        """The prefill for `msg` among live `candidates` (not empty)."""
        keys, per_key = prompt_keys(msg)
        least, idle = least_loaded(candidates)
        chosen = None
        matched = next((i for i in range(len(keys), 0, -1) if keys[i - 1] in self.last), 0)
        share = 1.0 if per_key == 0 else matched * per_key / max(1, len(msg.input_ids))
        if matched and share >= MIN_SHARE:
            warm = next((w for w in candidates if w.endpoint == self.last[keys[matched - 1]]), None)
            if warm is not None and warm.load <= 2 * least + SLACK:
                chosen = warm
        if chosen is None:
            chosen = random.choice(idle)
        for key in keys:
            self.last[key] = chosen.endpoint
            self.last.move_to_end(key)
        while len(self.last) > self.max_entries:
            self.last.popitem(last=False)
        return chosen


def least_loaded(workers: Sequence["Worker"]) -> tuple[int, list["Worker"]]:
    """The least load among `workers` (not empty) and the workers that have it, in one
    pass: the router does this for every request."""
    least, best = workers[0].load, []
    for w in workers:
        if w.load < least:
            least, best = w.load, [w]
        elif w.load == least:
            best.append(w)
    return least, best
