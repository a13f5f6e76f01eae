"""The first token a prefill sends ahead to a streamed request's router, as a record.

The router keeps it (`Flight.early`) until the decode sends that token itself; if a
pause retracts the request before its KV reached the decode, the router's `continue`
hands it to the decode (`Continue.early`: rid -> `to_wire()`), which resumes after it
so the client's token is the one the rest follows. Torch-free: the router imports it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from zpd.wire.messages import ProtocolError
from zpd.wire.tokens import TokenPart


@dataclass(frozen=True, slots=True)
class FirstToken:
    """One sampled token with its weight version and, where the request asked, its
    logprob, top alternatives [(token id, logprob), ...] and asked ids' logprobs."""

    token: int
    version: str
    logprob: Optional[float] = None
    top: Optional[list] = None
    ids_logprobs: Optional[list] = None

    @classmethod
    def of(cls, part: TokenPart) -> "FirstToken":
        """The part's first token."""
        return cls(part.token_ids[0], part.weight_versions[0],
                   None if part.logprobs is None else part.logprobs[0],
                   None if part.top_logprobs is None else part.top_logprobs[0],
                   None if part.ids_logprobs is None else part.ids_logprobs[0])

    def to_wire(self) -> list:
        """[token, version], then its logprob, [[token id, logprob], ...] alternatives
        (null when it has none) and asked ids' logprobs, each only where it or one
        after it is there (a top or ids entry comes only with a logprob)."""
        out: list = [self.token, self.version]
        if self.logprob is not None:
            out.append(self.logprob)
        if self.top is not None or self.ids_logprobs is not None:
            out.append(None if self.top is None else [list(pair) for pair in self.top])
        if self.ids_logprobs is not None:
            out.append(list(self.ids_logprobs))
        return out

    @classmethod
    def from_wire(cls, got: object) -> "FirstToken":
        """The record of a `to_wire` list; ProtocolError for anything else. The values
        beside the token are checked against what the request asked by its receiver
        (zpd/worker/parts.py `first_token_problem`)."""
        if not (isinstance(got, list) and 2 <= len(got) <= 5 and type(got[0]) is int
                and isinstance(got[1], str)):
            raise ProtocolError(f"early token {str(got)[:80]} is malformed")
        return cls(*got)
