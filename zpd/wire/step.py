"""A decode step's tokens for one router, as the router relays them without unpacking.

A worker sends each router one *step* per flush (a decode step's worth): a small
header frame ``{"v": PROTOCOL_VERSION, "type": "step", "frames": [n1, n2, ...]}``
followed by one body per client of that router (the `generate.owner` of its
requests), body i being the next ``n_i`` frames: a whole encoded ``Tokens`` message
with that client's parts, ready for the client to read. The router reads of each body
only its JSON header (`peek`: rids, counts, ends), checks that every rid in it is a
request of that client that this worker answers, and sends the body's frames on as
they came. Binding is free: the header the router checked is the header the client
reads. What fails the cheap check goes the slow way (decoded, filtered part by part).

A step is not a ``Message`` of the codec (``zpd.wire.protocol``): its bodies are,
and only the router reads the wrapper (``zpd.wire.net.Dealer.recv_frames``).
"""
from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Any, NamedTuple

import orjson

from zpd.wire.protocol import (MAX_FRAMES, PROTOCOL_VERSION, Message, ProtocolError, Tokens,
                               decode, encode)

STEP = "step"
# how every step's header begins (orjson keeps the keys in order): a step is told apart
# from a message without parsing its header twice
PREFIX = b'{"v":%d,"type":"step",' % PROTOCOL_VERSION
MAX_BODIES = 1 << 14      # clients in one step (a sender splits more): more is malformed
_INT32 = next(code for code in "ihl" if array(code).itemsize == 4)
_SWAP = array(_INT32, [1]).tobytes() != b"\x01\x00\x00\x00"     # a big-endian host


class Peek(NamedTuple):
    """What the router reads of one body: its rids, their token counts (parallel) and
    the ends of those that finished (rid -> {"finish", "meta"})."""
    rids: list
    counts: list
    ends: dict
    tokens: int


def pack_step(bodies: Sequence[Tokens]) -> list[bytes]:
    """The frames of one step of `bodies` (one ``Tokens`` per client)."""
    encoded = [encode(body) for body in bodies]
    out = [orjson.dumps({"v": PROTOCOL_VERSION, "type": STEP,
                         "frames": [len(frames) for frames in encoded]})]
    for frames in encoded:
        out.extend(frames)
    return out


def is_step(first: Any) -> bool:
    """Whether a message whose first frame is `first` (bytes or a zmq Frame) is a step."""
    return bytes(first.buffer[:len(PREFIX)] if hasattr(first, "buffer") else first[:len(PREFIX)]) \
        == PREFIX


def header_of(first: Any) -> dict:
    """A step's parsed header frame."""
    try:
        header = orjson.loads(first.buffer if hasattr(first, "buffer") else first)
    except (orjson.JSONDecodeError, TypeError) as e:
        raise ProtocolError(f"step header is not JSON ({e})") from None
    if type(header) is not dict:
        raise ProtocolError("step header is not a JSON object")
    return header


def decode_any(frames: Sequence[bytes]) -> Message:
    """``decode``, and a step as one ``Tokens`` of all its bodies' parts (for readers
    other than the router's relay: tests, tools)."""
    if not frames or not is_step(frames[0]):
        return decode(frames)
    parts = []
    for body in bodies(header_of(frames[0]), frames):
        msg = decode(body)
        if not isinstance(msg, Tokens):
            raise ProtocolError(f"step body is a {msg.TYPE}, not tokens")
        parts += msg.unpack()
    try:
        return Tokens.pack(parts)
    except ProtocolError as e:
        raise ProtocolError(f"step: {e.reason}") from None


def bodies(header: dict, frames: Sequence[Any]) -> list[Sequence[Any]]:
    """A step's bodies (frame slices) from its parsed `header` and all its frames;
    ProtocolError if they do not add up."""
    if header.get("v") != PROTOCOL_VERSION:
        raise ProtocolError(f"unsupported protocol version {header.get('v')!r} "
                            f"(want {PROTOCOL_VERSION})")
    sizes = header.get("frames")
    if type(sizes) is not list or not 1 <= len(sizes) <= MAX_BODIES or \
            not all(type(n) is int and 1 <= n <= MAX_FRAMES for n in sizes) or \
            sum(sizes) != len(frames) - 1:
        raise ProtocolError(f"step: frames {str(sizes)[:80]} for {len(frames) - 1} frames")
    out, at = [], 1
    for n in sizes:
        out.append(frames[at:at + n])
        at += n
    return out


def peek(body: Sequence[Any]) -> Peek:
    """The rids, counts and ends of one body (a ``Tokens`` message's frames; zmq
    Frames or bytes), from its header and its counts frame alone; ProtocolError if
    those are malformed. The rest (token ids, versions, logprobs) is its client's to
    check (``zpd.wire.protocol.decode``), as for any message it reads."""
    try:
        header = orjson.loads(_bytes(body[0]))
    except (orjson.JSONDecodeError, TypeError) as e:
        raise ProtocolError(f"step body header is not JSON ({e})") from None
    if type(header) is not dict or header.get("v") != PROTOCOL_VERSION or \
            header.get("type") != "tokens" or header.get("first", False) is not False:
        raise ProtocolError("step body is not a tokens message")
    rids, at, ends = header.get("rids"), header.get("counts"), header.get("ends", {})
    if type(rids) is not list or type(at) is not int or not 0 <= at < len(body) - 1 or \
            type(ends) is not dict:
        raise ProtocolError("step body: bad rids, counts or ends")
    raw = _bytes(body[at + 1])
    if len(raw) != 4 * len(rids):
        raise ProtocolError(f"step body: {len(raw)} bytes of counts for {len(rids)} rids")
    counts = array(_INT32)
    counts.frombytes(raw)
    if _SWAP:
        counts.byteswap()
    # rids that are not strings find no flight: their body goes the slow way
    if counts and min(counts) < 0 or (ends and not all(_end_ok(rid, end, rids)
                                                       for rid, end in ends.items())):
        raise ProtocolError("step body: a negative count, or a bad end")
    return Peek(rids, counts.tolist(), ends, sum(counts))


def _bytes(frame: Any) -> Any:
    """A frame's bytes: a zmq Frame's buffer (no copy), or the bytes themselves."""
    return frame if type(frame) is bytes else frame.buffer


def _end_ok(rid: str, end: Any, rids: list) -> bool:
    """An end as ``Tokens`` checks it: of a rid of the body, with a finish_reason."""
    return rid in rids and type(end) is dict and type(end.get("finish")) is dict and \
        type(end.get("meta", {})) is dict
