"""The control plane's wire format and its single codec; the typed messages it
carries are defined in ``zpd.wire.messages`` and ``zpd.wire.tokens`` and re-exported
here, with ``MESSAGE_TYPES``, every type by its wire name.

Wire: a multipart message ``[header, *blobs]``. ``header`` is an orjson object
``{"v": PROTOCOL_VERSION, "type": <TYPE>, ...fields}``. Fields typed
``list[int]`` (token ids, page ids) travel as their own frame of little-endian
int32, and ``list[float]`` (logprobs) as one of little-endian float32 (any float32,
NaN and infinities included); the header holds that frame's index, so large arrays
are never JSON-encoded. A ``list[bytes]`` field (routed experts, larger than one frame
may be) travels as that many frames of raw bytes, at most MAX_PIECES, untouched by the
codec; the header holds [first frame's index, count]. A field typed as a record (a class with ``to_wire`` and a
``from_dict`` that checks a peer's object) travels as that object, and a
``dict[str, Record]`` as an object of them. An optional field whose value is None is
left out of the header (and so costs no frame). ``decode`` turns any malformed input into
``ProtocolError``.

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
from typing import Any, NamedTuple

import orjson

# The usual import path for every message name (``from zpd.wire.protocol import ...``).
from zpd.wire.messages import (
    Abort, Accepted, Admin, AdminReply, Adopt, Adopted, Error, Generate, Hello, HelloAck, KvDest,
    KvDone, KvFailed, Message, Ping, Pong, ProtocolError, Recompute, Resume, new_room)
from zpd.wire.rows import MAX_PIECES, Rows
from zpd.wire.tokens import TokenPart, Tokens

__all__ = ["Abort", "Accepted", "Admin", "AdminReply", "Adopt", "Adopted", "Error",
           "Generate", "Hello", "HelloAck", "KvDest", "KvDone", "KvFailed", "Message",
           "Ping", "Pong", "ProtocolError", "Recompute", "Resume", "Rows", "TokenPart",
           "Tokens", "new_room", "MESSAGE_TYPES", "PROTOCOL_VERSION", "MAX_FRAME_BYTES",
           "MAX_FRAMES", "encode", "decode"]

# 2: kv_dest states cached_pages; admin args say weight_version. 3: hello and hello_ack
# announce one pool per tensor-parallel rank (`pools`) instead of one `base_addr`.
# 4: a restarted router adopts its predecessor's requests (adopt, adopted; generate's
# owner) and clients resume them (resume; the router's boot id in accepted, ping, pong).
# 5: records in place of free dicts: generate's and recompute's sampling (only the
# parameters that differ from their defaults), hello's layout, kv_done's timings,
# adopted's requests; each is checked once, by the decode.
# 6: routed experts compact and in pieces: kv_done's as raw frames (uint8 ids where the
# model has at most 256 experts), the answer's in a `rows` message ahead of the final
# tokens (zpd/wire/rows.py); adopted requests say whether they asked for them.
# 7: a worker sends each router a step (zpd/wire/step.py): one tokens body per client,
# which the router passes on unread; a tokens message says where each part starts.
PROTOCOL_VERSION = 7

MESSAGE_TYPES: Mapping[str, type[Message]] = types.MappingProxyType(
    {cls.TYPE: cls for cls in (Generate, Hello, HelloAck, KvDest, KvDone, KvFailed, Recompute,
                               Tokens, Rows, Accepted, Abort, Admin, AdminReply, Ping, Pong,
                               Error, Resume, Adopt, Adopted)})

# The largest frame a bound socket accepts (ZeroMQ's MAXMSGSIZE bounds each frame, not
# a message). The largest legitimate ones are a generate's: its ids as int32 (at most
# 4M ids fit) and its text inside the JSON header (zpd.config.PromptLimits keeps both
# well inside); a kv_dest's page ids are fewer than its prompt's tokens.
MAX_FRAME_BYTES = 16 << 20

# 'i' is 4 bytes on every platform CPython supports; pick by size anyway so a
# blob is always int32, whatever the C int is.
_INT32_CODE = next(code for code in "ihl" if array(code).itemsize == 4)
_FLOAT32_CODE = "f"                      # C float: IEEE 754 binary32 wherever CPython runs
_BIG_ENDIAN = sys.byteorder == "big"


# --- field specs, derived once from the annotations ----------------------------

_KINDS: Mapping[Any, str] = types.MappingProxyType(
    {int: "int", float: "float", str: "str", bool: "bool", dict: "dict",
     list[int]: "blob", list[float]: "f32blob", list[str]: "strs", list[list[int]]: "intlists",
     list[bytes]: "pieces"}
)
# blob kind -> (array typecode, what it holds)
_BLOBS: Mapping[str, tuple[str, str]] = types.MappingProxyType(
    {"blob": (_INT32_CODE, "int32"), "f32blob": (_FLOAT32_CODE, "float32")})


class _Field(NamedTuple):
    name: str
    kind: str
    optional: bool
    required: bool
    omit_none: bool              # optional with a None default: None is not sent at all
    record: Any = None           # kinds "record", "records": the class (its to_wire, from_dict)


def _field_of(f: dataclasses.Field, hint: Any) -> _Field:
    optional = False
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args:
        (hint,) = [a for a in args if a is not type(None)]
        optional = True
    required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    if hasattr(hint, "to_wire"):
        return _Field(f.name, "record", optional, required, optional and f.default is None, hint)
    if typing.get_origin(hint) is dict and hasattr(typing.get_args(hint)[1], "to_wire"):
        # dict[str, Record]: an object of records, by key
        return _Field(f.name, "records", optional, required, False, typing.get_args(hint)[1])
    return _Field(f.name, _KINDS[hint], optional, required, optional and f.default is None)


def _spec(cls: type[Message]) -> tuple[_Field, ...]:
    hints = typing.get_type_hints(cls)
    fields = tuple(_field_of(f, hints[f.name]) for f in dataclasses.fields(cls)
                   if f.metadata.get("wire", True))
    assert not {"v", "type"} & {f.name for f in fields}, "reserved header key"
    return fields


_SPECS: Mapping[type[Message], tuple[_Field, ...]] = types.MappingProxyType(
    {cls: _spec(cls) for cls in MESSAGE_TYPES.values()}
)

# The header plus the most blobs and pieces any type has: a message with more frames is
# refused before its header is even parsed (ZeroMQ bounds frames, never their number).
MAX_FRAMES = 1 + max(sum(1 if f.kind in _BLOBS else MAX_PIECES if f.kind == "pieces" else 0
                         for f in spec) for spec in _SPECS.values())

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
    # a few small rows (a hello's pools; addresses pass int32): JSON in the header
    "intlists": lambda v: type(v) is list and all(
        type(row) is list and all(type(x) is int for x in row) for row in v),
    "blob": lambda v: True,
    "f32blob": lambda v: True,
    "pieces": lambda v: True,
    "record": lambda v: type(v) is dict,   # and then by the record's own from_dict
    "records": lambda v: type(v) is dict,  # and each value by the record's from_dict
})


def _pack_blob(name: str, kind: str, values: Sequence[int] | Sequence[float]) -> bytes:
    code, what = _BLOBS[kind]
    if code == _FLOAT32_CODE and not all(type(v) is float or type(v) is int for v in values):
        raise ProtocolError(f"field {name!r}: not a list of floats")   # array() takes bools
    try:
        arr = array(code, values)
    except (TypeError, OverflowError) as e:
        raise ProtocolError(f"field {name!r}: not a list of {what} ({e})") from None
    if _BIG_ENDIAN:
        arr.byteswap()
    return arr.tobytes()


def _unpack_blob(name: str, kind: str, blob: bytes) -> list[int] | list[float]:
    code, what = _BLOBS[kind]
    if len(blob) % 4:
        raise ProtocolError(f"field {name!r}: blob of {len(blob)} bytes is not {what}[]")
    arr = array(code)
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
        if value is None and f.omit_none:
            continue
        if value is None and f.optional:
            header[f.name] = None
        elif f.kind in _BLOBS:
            header[f.name] = len(blobs)
            blobs.append(_pack_blob(f.name, f.kind, value))
        elif f.kind == "pieces":
            header[f.name] = [len(blobs), _pieces_count(f.name, value)]
            blobs.extend(value)
        elif f.kind == "record":
            if not isinstance(value, f.record):
                raise ProtocolError(f"field {f.name!r}: expected {f.record.__name__}, "
                                    f"got {type(value).__name__}")
            header[f.name] = value.to_wire()
        elif f.kind == "records":
            header[f.name] = _records_to_wire(f, value)
        elif _TYPE_OK[f.kind](value):
            header[f.name] = value
        else:
            raise ProtocolError(f"field {f.name!r}: expected {f.kind}, got {type(value).__name__}")
    try:
        return [orjson.dumps(header), *blobs]
    except (TypeError, orjson.JSONEncodeError) as e:
        raise ProtocolError(f"{msg.TYPE}: header not serializable ({e})") from None


def _records_to_wire(f: _Field, value: Any) -> dict[str, Any]:
    if type(value) is not dict or not all(type(k) is str and isinstance(v, f.record)
                                          for k, v in value.items()):
        raise ProtocolError(f"field {f.name!r}: expected a dict of str to {f.record.__name__}")
    return {key: record.to_wire() for key, record in value.items()}


def _pieces_count(name: str, value: Any) -> int:
    if type(value) is not list or not all(type(v) is bytes for v in value):
        raise ProtocolError(f"field {name!r}: expected a list of bytes")
    if not 1 <= len(value) <= MAX_PIECES:
        raise ProtocolError(f"field {name!r}: {len(value)} pieces, not 1..{MAX_PIECES}")
    return len(value)


def _read_header(frames: Sequence[bytes]) -> dict[str, Any]:
    if not frames:
        raise ProtocolError("empty message")
    if len(frames) > MAX_FRAMES:
        raise ProtocolError(f"{len(frames)} frames; no message has more than {MAX_FRAMES}")
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
    if f.kind in _BLOBS:
        if type(raw) is not int:
            raise ProtocolError(f"field {f.name!r}: blob index must be int")
        if not 0 <= raw < len(frames) - 1:
            raise ProtocolError(f"field {f.name!r}: blob index {raw} out of range")
        return _unpack_blob(f.name, f.kind, frames[raw + 1])
    if f.kind == "pieces":
        return _read_pieces(f.name, raw, frames)
    if not _TYPE_OK[f.kind](raw):
        raise ProtocolError(f"field {f.name!r}: expected {f.kind}, got {type(raw).__name__}")
    if f.kind == "record":
        return f.record.from_dict(raw)
    return float(raw) if f.kind == "float" else raw


def _read_pieces(name: str, raw: Any, frames: Sequence[bytes]) -> list[bytes]:
    """A ``list[bytes]`` field's frames, named [first index, count] in the header."""
    if type(raw) is not list or len(raw) != 2 or not all(type(v) is int for v in raw):
        raise ProtocolError(f"field {name!r}: pieces must be [first index, count]")
    first, count = raw
    if not 1 <= count <= MAX_PIECES or not 0 <= first <= len(frames) - 1 - count:
        raise ProtocolError(f"field {name!r}: pieces {raw} out of range")
    return [bytes(frames[first + 1 + i]) for i in range(count)]


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
            kwargs[f.name] = _checked_value(cls, f, header[f.name], frames, kwargs)
        elif f.required:
            raise ProtocolError(f"{type_name}: missing field {f.name!r}")
    return cls(**kwargs)


def _checked_value(cls: type[Message], f: _Field, raw: Any, frames: Sequence[bytes],
                  kwargs: dict[str, Any]) -> Any:
    """One field's value. A record the field's own check refuses makes the message
    malformed, except in a message with a ``refused`` field (a generate, a recompute):
    that one is kept, with the reason there and the record's defaults, so that its
    receiver answers the request (400) instead of leaving its sender waiting."""
    if f.kind == "records":
        return _records(cls, f, raw, kwargs)
    try:
        return _field_value(f, raw, frames)
    except ProtocolError:
        raise
    except ValueError as e:
        if "refused" not in cls.__dataclass_fields__:
            raise ProtocolError(f"field {f.name!r}: {e}") from None
        kwargs["refused"] = str(e)
        return f.record()


def _records(cls: type[Message], f: _Field, raw: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """An object of records, by key. An entry its record's check refuses makes the
    message malformed, except in a message with a ``refused`` map (an adopted): there
    its key is kept with the reason, so that the receiver ends what the key names."""
    if not _TYPE_OK["records"](raw):
        raise ProtocolError(f"field {f.name!r}: expected an object, got {type(raw).__name__}")
    kept: dict[str, Any] = {}
    refused: dict[str, str] = {}
    for key, entry in raw.items():
        try:
            kept[key] = f.record.from_dict(entry)
        except ValueError as e:
            if "refused" not in cls.__dataclass_fields__:
                raise ProtocolError(f"field {f.name!r}: entry {key!r:.80}: {e}") from None
            refused[key] = str(e)
    if refused:
        kwargs["refused"] = refused
    return kept
