"""Small records that wire messages carry inside a field: a kv_done's timings and an
adopted request. Each is sent as a JSON object (``to_wire``) and read back by
``from_dict``, the wire decode's one check of what a peer sent; keys a record does
not know are ignored, as a header's are."""
from __future__ import annotations

import math
from dataclasses import MISSING, asdict, dataclass, fields
from typing import Any

INT32_MAX = 2**31 - 1


def _known(cls: type, raw: object, what: str) -> dict[str, Any]:
    """`raw`'s values of `cls`'s fields, every one without a default present."""
    if not isinstance(raw, dict):
        raise ValueError(f"{what} must be an object, got {type(raw).__name__}")
    missing = [f.name for f in fields(cls) if f.name not in raw and f.default is MISSING]
    if missing:
        raise ValueError(f"{what} lacks {', '.join(missing)}")
    return {f.name: raw[f.name] for f in fields(cls) if f.name in raw}


@dataclass(frozen=True, slots=True)
class KvTimings:
    """Milliseconds a written job spent in each step at its prefill (the names of
    engines.request.Request.timings): generate received -> forward starts, the forward,
    forward done -> the decode's destination known, write submitted -> complete."""
    prefill_queue: float
    prefill_forward: float
    kv_dest_wait: float
    kv_transfer: float

    def to_wire(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: object) -> "KvTimings":
        """A prefill's timings: each a finite number of milliseconds, not negative."""
        values = _known(cls, raw, "timings")
        for name, value in values.items():
            if type(value) not in (int, float) or not 0 <= value < math.inf:
                raise ValueError(f"timings: {name} must be a finite number >= 0, got {value!r:.40}")
        return cls(**{name: float(value) for name, value in values.items()})


@dataclass(frozen=True, slots=True)
class AdoptedRequest:
    """One request a decode hands over to a restarted router: its client's identity
    (hex, as Generate.owner), its prefill's endpoint, whether it streams, its share
    (prompt + max_new_tokens), the tokens generated so far, and whether it asked for its
    routed experts (zpd/wire/rows.py)."""
    owner: str
    prefill: str
    stream: bool
    tokens: int
    output: int
    routed: bool = False

    @property
    def client(self) -> bytes:
        """The owner's identity on the router's client socket."""
        return bytes.fromhex(self.owner)

    def to_wire(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: object) -> "AdoptedRequest":
        """An entry of a decode's Adopted: a client identity, strings, counts in int32."""
        values = _known(cls, raw, "an adopted request")
        entry = cls(**values)
        problem = entry._problem()
        if problem:
            raise ValueError(f"adopted request: {problem}")
        return entry

    def _problem(self) -> str:
        if type(self.owner) is not str or not self.owner or not _hex(self.owner):
            return f"owner {self.owner!r:.80} is no client identity in hex"
        if type(self.prefill) is not str:
            return f"prefill must be an endpoint, got {type(self.prefill).__name__}"
        if type(self.stream) is not bool or type(self.routed) is not bool:
            return "stream and routed must be true or false"
        for name in ("tokens", "output"):
            if type(getattr(self, name)) is not int or not 0 <= getattr(self, name) <= INT32_MAX:
                return f"{name} must be an integer in [0, {INT32_MAX}]"
        return ""


def _hex(text: str) -> bool:
    try:
        bytes.fromhex(text)
    except ValueError:
        return False
    return True
