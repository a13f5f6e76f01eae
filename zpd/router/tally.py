"""What the router has sent its clients, counted as it goes (never reset), for the
`status` admin command and so for /metrics: every token a client receives (a streamed
request's first token from its prefill included), every request's end by reason and,
for aborts and failures, by status code, and the prompt tokens the ended requests'
prefills took from their prefix caches. `gen_throughput` is the tokens clients
received per second over the last few seconds (zpd/wire/recent.py)."""
from __future__ import annotations

from collections import Counter

from zpd.wire.protocol import Tokens
from zpd.wire.recent import Recent

THROUGHPUT_SPAN_S = 10


class Tally:
    def __init__(self) -> None:
        self.generation_tokens = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.retractions = 0
        self.finished: Counter[str] = Counter()      # finish reason type -> requests
        self.aborted: Counter[str] = Counter()       # status code -> requests ended so
        self.recent = Recent(THROUGHPUT_SPAN_S)      # tokens sent, per second

    def count(self, msg: object) -> None:
        if isinstance(msg, Tokens):
            self.add(len(msg.token_ids), msg.ends)

    def add(self, tokens: int, ends: dict) -> None:
        """`tokens` sent to a client and `ends`, a Tokens message's (rid -> {"finish",
        "meta"}), as Tokens (or zpd.wire.step.peek) checks them: dicts all the way."""
        self.generation_tokens += tokens
        if tokens:
            self.recent.add(tokens)
        for end in ends.values():
            finish, meta = end["finish"], end.get("meta", {})
            kind = str(finish.get("type"))
            self.finished[kind] += 1
            if kind == "abort":
                self.aborted[str(finish.get("status_code"))] += 1
            prompt = _count(meta.get("prompt_tokens"))
            self.prompt_tokens += prompt
            self.cached_tokens += min(_count(meta.get("cached_tokens")), prompt)
            self.retractions += _count(meta.get("retractions"))

    def fields(self) -> dict:
        return {"generation_tokens": self.generation_tokens, "prompt_tokens": self.prompt_tokens,
                "cached_tokens": self.cached_tokens, "retractions": self.retractions,
                "finished": dict(self.finished), "aborted": dict(self.aborted),
                "gen_throughput": round(self.recent.per_second(), 3)}


def _count(value: object) -> int:
    # meta comes from a worker: count only what is a plain non-negative int
    return value if type(value) is int and value >= 0 else 0
