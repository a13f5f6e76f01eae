"""Typed, versioned control-plane messages and their single codec.

Wire: a multipart message ``[header, *blobs]``. ``header`` is an orjson object
``{"v": PROTOCOL_VERSION, "type": <TYPE>, ...fields}``. Fields typed
``list[int]`` (token ids, page ids) travel as their own frame of little-endian
int32 and the header holds that frame's index, so large id arrays are never
JSON-encoded. ``decode`` turns any malformed input into ``ProtocolError``.

Header keys the receiver does not know are ignored, so a newer sender may add
optional fields without a version bump; removing or retyping a field needs one.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import types
import typing
from array import array
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple, Optional

import orjson

PROTOCOL_VERSION = 1

# 'i' is 4 bytes on every platform CPython supports; pick by size anyway so a
# blob is always int32, whatever the C int is.
_INT32_CODE = next(code for code in "ihl" if array(code).itemsize == 4)
_BIG_ENDIAN = sys.byteorder == "big"


class ProtocolError(ValueError):
    """A message could not be encoded or decoded; ``reason`` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Message:
    """Base of every wire message; subclasses are frozen slotted dataclasses."""

    __slots__ = ()
    TYPE: ClassVar[str] = ""


# --- message types -----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Generate(Message):
    """Start a request. A client sends room=0; the router assigns room/epoch
    and names the prefill and decode endpoints chosen for it."""

    TYPE: ClassVar[str] = "generate"
    rid: str
    input_ids: list[int]
    sampling: dict = field(default_factory=dict)
    stream: bool = False
    room: int = 0
    epoch: int = 0
    prefill: str = ""
    decode: str = ""
    text: str = ""  # a text prompt, tokenized by the workers, when input_ids is empty


@dataclass(frozen=True, slots=True)
class Hello(Message):
    """Decode → prefill handshake. ``layout`` holds num_layers, page_size,
    page_bytes, dtype, num_kv_heads, head_dim; ``base_addr``/``num_pages``
    describe the decode's registered KV pool that prefill will write into."""

    TYPE: ClassVar[str] = "hello"
    decode: str
    layout: dict
    compat_hash: str
    session_id: str
    base_addr: int
    num_pages: int
    weight_version: str


@dataclass(frozen=True, slots=True)
class HelloAck(Message):
    """Prefill → decode answer to Hello, with the prefill's own layout, hash,
    Mooncake session and pool; ok=False carries the mismatch in ``reason``."""

    TYPE: ClassVar[str] = "hello_ack"
    ok: bool
    layout: dict
    compat_hash: str
    session_id: str
    base_addr: int
    num_pages: int
    weight_version: str
    reason: str = ""


@dataclass(frozen=True, slots=True)
class KvDest(Message):
    """Decode → prefill: where to write this request's KV pages. ``aux_slot``
    is the decode's auxiliary-buffer slot for the request (-1: none)."""

    TYPE: ClassVar[str] = "kv_dest"
    room: int
    epoch: int
    rid: str
    page_ids: list[int]
    aux_slot: int = -1


@dataclass(frozen=True, slots=True)
class KvDone(Message):
    """Prefill → decode: the KV is written; ``first_token`` was sampled under
    ``weight_version``."""

    TYPE: ClassVar[str] = "kv_done"
    room: int
    epoch: int
    first_token: int
    weight_version: str
    timings: dict = field(default_factory=dict)   # milliseconds, see engines.request.Request.timings


@dataclass(frozen=True, slots=True)
class KvFailed(Message):
    """Either direction: the transfer for (room, epoch) is abandoned; ``status``
    is one of the DESIGN status codes."""

    TYPE: ClassVar[str] = "kv_failed"
    room: int
    epoch: int
    status: int
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Recompute(Message):
    """Decode → prefill after a retraction: rebuild KV for prompt + output[:-1]
    under the current weights, as (room, epoch+1)."""

    TYPE: ClassVar[str] = "recompute"
    rid: str
    room: int
    epoch: int
    input_ids: list[int]
    sampling: dict = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Token(Message):
    """Decode → router → client: new tokens, one weight version per token;
    ``finish`` is the finish_reason object once ``finished``."""

    TYPE: ClassVar[str] = "token"
    rid: str
    token_ids: list[int]
    weight_versions: list[str]
    finished: bool = False
    finish: Optional[dict] = None
    meta: dict = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Tokens(Message):
    """Decode → router → client: many requests' new tokens in one message (a decode
    step's worth), so a step costs one send per peer instead of one per request.
    Parallel arrays: request ``rids[i]`` gets the next ``counts[i]`` entries of
    ``token_ids`` and ``weight_versions``; ``ends`` maps each finished rid to
    ``{"finish": finish_reason, "meta": meta}``."""

    TYPE: ClassVar[str] = "tokens"
    rids: list[str]
    counts: list[int]
    token_ids: list[int]
    weight_versions: list[str]
    ends: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.counts) != len(self.rids) or any(c < 0 for c in self.counts):
            raise ProtocolError(f"tokens: {len(self.counts)} counts for {len(self.rids)} rids")
        if sum(self.counts) != len(self.token_ids) or len(self.token_ids) != len(self.weight_versions):
            raise ProtocolError(f"tokens: counts sum to {sum(self.counts)} but there are "
                                f"{len(self.token_ids)} ids and {len(self.weight_versions)} versions")
        rids = set(self.rids)
        if len(rids) != len(self.rids):
            raise ProtocolError("tokens: a rid appears twice")
        for rid, end in self.ends.items():
            if rid not in rids or type(end) is not dict or type(end.get("meta", {})) is not dict:
                raise ProtocolError(f"tokens: bad end for rid {rid!r}")

    @classmethod
    def pack(cls, parts: Sequence[Token]) -> "Tokens":
        """One message for many Token parts (distinct rids)."""
        return cls([t.rid for t in parts], [len(t.token_ids) for t in parts],
                   [i for t in parts for i in t.token_ids],
                   [v for t in parts for v in t.weight_versions],
                   {t.rid: {"finish": t.finish, "meta": t.meta} for t in parts if t.finished})

    def unpack(self) -> list[Token]:
        """The parts, in order."""
        out, at = [], 0
        for rid, n in zip(self.rids, self.counts):
            end = self.ends.get(rid)
            out.append(Token(rid, self.token_ids[at:at + n], self.weight_versions[at:at + n],
                             end is not None, end and end.get("finish"), (end or {}).get("meta", {})))
            at += n
        return out


@dataclass(frozen=True, slots=True)
class Abort(Message):
    """Client/admin → router → workers: end ``rid`` with ``status``."""

    TYPE: ClassVar[str] = "abort"
    rid: str
    status: int = 499
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Admin(Message):
    """Admin command (pause, continue, update_weights, status, ...); the reply
    echoes ``req_id`` so a fan-out can match answers."""

    TYPE: ClassVar[str] = "admin"
    command: str
    args: dict = field(default_factory=dict)
    req_id: str = ""


@dataclass(frozen=True, slots=True)
class AdminReply(Message):
    """Answer to one Admin message."""

    TYPE: ClassVar[str] = "admin_reply"
    req_id: str
    ok: bool
    result: dict = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Ping(Message):
    """Heartbeat; the receiver answers Pong echoing ``seq`` and ``sent_at``."""

    TYPE: ClassVar[str] = "ping"
    seq: int
    sent_at: float
    sender: str = ""


@dataclass(frozen=True, slots=True)
class Pong(Message):
    """Heartbeat answer; ``sent_at`` is the Ping's, so RTT needs one clock."""

    TYPE: ClassVar[str] = "pong"
    seq: int
    sent_at: float
    sender: str = ""


@dataclass(frozen=True, slots=True)
class Error(Message):
    """Reply to a message that could not be handled when the sender is known
    (e.g. malformed or unexpected); ``rid`` is set when one could be read."""

    TYPE: ClassVar[str] = "error"
    status: int
    reason: str
    rid: str = ""


MESSAGE_TYPES: Mapping[str, type[Message]] = types.MappingProxyType(
    {
        cls.TYPE: cls
        for cls in (Generate, Hello, HelloAck, KvDest, KvDone, KvFailed, Recompute,
                    Token, Tokens, Abort, Admin, AdminReply, Ping, Pong, Error)
    }
)

# --- field specs, derived once from the annotations ----------------------------

_KINDS: Mapping[Any, str] = types.MappingProxyType(
    {int: "int", float: "float", str: "str", bool: "bool", dict: "dict",
     list[int]: "blob", list[str]: "strs"}
)


class _Field(NamedTuple):
    name: str
    kind: str
    optional: bool
    required: bool


def _field_of(f: dataclasses.Field, hint: Any) -> _Field:
    optional = False
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args:
        (hint,) = [a for a in args if a is not type(None)]
        optional = True
    required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    return _Field(f.name, _KINDS[hint], optional, required)


def _spec(cls: type[Message]) -> tuple[_Field, ...]:
    hints = typing.get_type_hints(cls)
    fields = tuple(_field_of(f, hints[f.name]) for f in dataclasses.fields(cls))
    assert not {"v", "type"} & {f.name for f in fields}, "reserved header key"
    return fields


_SPECS: Mapping[type[Message], tuple[_Field, ...]] = types.MappingProxyType(
    {cls: _spec(cls) for cls in MESSAGE_TYPES.values()}
)

# --- codec ---------------------------------------------------------------------


# bool is an int subclass in Python; JSON keeps them apart, and so do we.
# Blobs are checked where they are packed or unpacked.
_TYPE_OK: Mapping[str, Callable[[Any], bool]] = types.MappingProxyType({
    "int": lambda v: type(v) is int,
    # orjson would write NaN/inf as null, which the receiver then rejects.
    "float": lambda v: type(v) is int or (type(v) is float and math.isfinite(v)),
    "str": lambda v: type(v) is str,
    "bool": lambda v: type(v) is bool,
    "dict": lambda v: type(v) is dict,
    "strs": lambda v: type(v) is list and all(type(s) is str for s in v),
    "blob": lambda v: True,
})


def _pack_int32(name: str, values: Sequence[int]) -> bytes:
    try:
        arr = array(_INT32_CODE, values)
    except (TypeError, OverflowError) as e:
        raise ProtocolError(f"field {name!r}: not a list of int32 ({e})") from None
    if _BIG_ENDIAN:
        arr.byteswap()
    return arr.tobytes()


def _unpack_int32(name: str, blob: bytes) -> list[int]:
    if len(blob) % 4:
        raise ProtocolError(f"field {name!r}: blob of {len(blob)} bytes is not int32[]")
    arr = array(_INT32_CODE)
    arr.frombytes(blob)
    if _BIG_ENDIAN:
        arr.byteswap()
    return arr.tolist()


def encode(msg: Message) -> list[bytes]:
    """Serialize ``msg`` to frames; raises ProtocolError if a field has the
    wrong type, so a bad message fails at its sender, not its receiver."""
    spec = _SPECS.get(type(msg))
    if spec is None:
        raise ProtocolError(f"not a registered message: {type(msg).__name__}")
    header: dict[str, Any] = {"v": PROTOCOL_VERSION, "type": msg.TYPE}
    blobs: list[bytes] = []
    for f in spec:
        value = getattr(msg, f.name)
        if value is None and f.optional:
            header[f.name] = None
        elif f.kind == "blob":
            header[f.name] = len(blobs)
            blobs.append(_pack_int32(f.name, value))
        elif _TYPE_OK[f.kind](value):
            header[f.name] = value
        else:
            raise ProtocolError(f"field {f.name!r}: expected {f.kind}, got {type(value).__name__}")
    try:
        return [orjson.dumps(header), *blobs]
    except (TypeError, orjson.JSONEncodeError) as e:
        raise ProtocolError(f"{msg.TYPE}: header not serializable ({e})") from None


def _read_header(frames: Sequence[bytes]) -> dict[str, Any]:
    if not frames:
        raise ProtocolError("empty message")
    try:
        header = orjson.loads(frames[0])
    except (orjson.JSONDecodeError, TypeError) as e:
        raise ProtocolError(f"header is not JSON ({e})") from None
    if type(header) is not dict:
        raise ProtocolError("header is not a JSON object")
    v = header.get("v")
    if type(v) is not int or v != PROTOCOL_VERSION:
        raise ProtocolError(f"unsupported protocol version {v!r} (want {PROTOCOL_VERSION})")
    return header


def _field_value(f: _Field, raw: Any, frames: Sequence[bytes]) -> Any:
    if raw is None and f.optional:
        return None
    if f.kind == "blob":
        if type(raw) is not int:
            raise ProtocolError(f"field {f.name!r}: blob index must be int")
        if not 0 <= raw < len(frames) - 1:
            raise ProtocolError(f"field {f.name!r}: blob index {raw} out of range")
        return _unpack_int32(f.name, frames[raw + 1])
    if not _TYPE_OK[f.kind](raw):
        raise ProtocolError(f"field {f.name!r}: expected {f.kind}, got {type(raw).__name__}")
    return float(raw) if f.kind == "float" else raw


def decode(frames: Sequence[bytes]) -> Message:
    """Parse frames into a Message; any malformed input raises ProtocolError."""
    header = _read_header(frames)
    type_name = header.get("type")
    cls = MESSAGE_TYPES.get(type_name) if type(type_name) is str else None
    if cls is None:
        raise ProtocolError(f"unknown message type {type_name!r}")
    kwargs: dict[str, Any] = {}
    for f in _SPECS[cls]:
        if f.name in header:
            kwargs[f.name] = _field_value(f, header[f.name], frames)
        elif f.required:
            raise ProtocolError(f"{type_name}: missing field {f.name!r}")
    return cls(**kwargs)
