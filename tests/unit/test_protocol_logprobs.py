"""Codec tests of logprobs: float32 blobs, sent only for the requests that asked, and
every inconsistency a ProtocolError. The other messages: test_protocol.py."""

from __future__ import annotations

import struct

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.test_protocol import header, struct_ids
from zpd.wire import protocol as p
from zpd.wire.first_token import FirstToken
from zpd.wire.protocol import ProtocolError, decode, encode


# --- logprobs: float32 blobs, only for the requests that asked ---------------------------


def test_float_blob_is_little_endian_float32() -> None:
    frames = encode(p.KvDone(room=1, epoch=0, first_token=3, weight_version="v",
                             logprob=[-0.1]))
    assert frames[header(frames)["logprob"] + 1] == struct.pack("<f", -0.1)
    assert decode(frames).logprob == [struct.unpack("<f", struct.pack("<f", -0.1))[0]]


@given(st.lists(st.floats(width=32), max_size=50))
@settings(max_examples=200, deadline=None)
def test_fuzz_round_trip_float32(values: list[float]) -> None:
    n = len(values)
    msg = p.Tokens(rids=["r"], counts=[n], token_ids=[1] * n, weight_versions=["v"] * n,
                   logprob_mode=[1], logprobs=values)
    assert repr(decode(encode(msg)).logprobs) == repr(values)     # NaN and infinities too


def test_no_logprob_frames_when_no_request_asked() -> None:
    frames = encode(p.Tokens.pack([p.TokenPart("a", [1, 2], ["v", "v"])]))
    assert len(frames) == 3 and "logprobs" not in header(frames)
    assert "logprob" not in header(encode(p.KvDone(room=1, epoch=0, first_token=3,
                                                   weight_version="v")))


def test_tokens_mixing_requests_with_and_without_logprobs_round_trip() -> None:
    parts = [p.TokenPart("a", [1, 2], ["v", "v"], logprobs=[-0.5, -0.25],
                         top_logprobs=[[(1, -0.5), (3, -1.0)], [(2, -0.25)]]),
             p.TokenPart("b", [3], ["v"]),
             p.TokenPart("c", [4], ["v"], {"type": "length"}, {"n": 1}, logprobs=[-2.0]),
             p.TokenPart("d", [], [], {"type": "abort", "status_code": 499}, {},
                         logprobs=[], top_logprobs=[])]
    got = decode(encode(p.Tokens.pack(parts)))
    assert got.logprob_mode == [2, 0, 1, 2]
    assert got.unpack() == parts
    assert [t.logprob_mode for t in got.unpack()] == [2, 0, 1, 2]


def test_token_part_skip_and_then_keep_logprobs_aligned() -> None:
    a = p.TokenPart("a", [1, 2], ["v", "v"], logprobs=[-0.5, -0.25], top_logprobs=[[(1, -0.5)], []])
    b = p.TokenPart("a", [3], ["w"], {"type": "length"}, {}, logprobs=[-1.0], top_logprobs=[[(3, -1.0)]])
    both = a.then(b)
    assert both.logprobs == [-0.5, -0.25, -1.0] and both.finished
    assert both.skip(2) == p.TokenPart("a", [3], ["w"], {"type": "length"}, {}, [-1.0], [[(3, -1.0)]])
    assert FirstToken.of(a).to_wire() == [1, "v", -0.5, [[1, -0.5]]]
    assert FirstToken.of(p.TokenPart("b", [7], ["v"])).to_wire() == [7, "v"]
    assert FirstToken.from_wire([1, "v", -0.5, [[1, -0.5]]]) == FirstToken(1, "v", -0.5, [[1, -0.5]])
    with pytest.raises(p.ProtocolError, match="malformed"):
        FirstToken.from_wire([1.0, "v"])


def _tokens_frames(**fields) -> list[bytes]:
    """A tokens message of two rids (2 and 1 tokens), logprob fields as given: ints and
    floats packed into their blobs, None left out."""
    head = {"v": p.PROTOCOL_VERSION, "type": "tokens", "rids": ["a", "b"], "counts": 0,
            "token_ids": 1, "weight_versions": ["v"] * 3}
    frames = [struct_ids([2, 1]), struct_ids([4, 5, 6])]
    for name, value in fields.items():
        if value is None:
            continue
        head[name] = len(frames)
        floats = name in ("logprobs", "top_logprobs")
        frames.append(struct.pack(f"<{len(value)}{'f' if floats else 'i'}", *value))
    return [orjson.dumps(head), *frames]


def test_tokens_frames_helper_makes_a_valid_message() -> None:
    got = decode(_tokens_frames(logprob_mode=[2, 1], logprobs=[-1, -2, -3], top_counts=[1, 0],
                                top_ids=[9], top_logprobs=[-0.5]))
    assert [t.logprobs for t in got.unpack()] == [[-1, -2], [-3]]
    assert got.unpack()[0].top_logprobs == [[(9, -0.5)], []]


@pytest.mark.parametrize("fields", [
    dict(logprobs=[-1.0, -2.0, -3.0]),                                # arrays without a mode
    dict(logprob_mode=[1]),                                           # a mode per rid
    dict(logprob_mode=[1, 3], logprobs=[-1.0, -2.0, -3.0]),           # no such mode
    dict(logprob_mode=[1, 0]),                                        # logprobs missing
    dict(logprob_mode=[1, 0], logprobs=[-1.0]),                       # too few
    dict(logprob_mode=[1, 0], logprobs=[-1.0, -2.0, -3.0]),           # too many
    dict(logprob_mode=[1, 1], logprobs=[-1.0, -2.0, -3.0], top_counts=[0, 0, 0],
         top_ids=[], top_logprobs=[]),                                # top without mode 2
    dict(logprob_mode=[2, 0], logprobs=[-1.0, -2.0]),                 # mode 2 without top
    dict(logprob_mode=[2, 0], logprobs=[-1.0, -2.0], top_counts=[1],
         top_ids=[1], top_logprobs=[-1.0]),                           # a top count per token
    dict(logprob_mode=[2, 0], logprobs=[-1.0, -2.0], top_counts=[1, -1],
         top_ids=[], top_logprobs=[]),                                # negative count
    dict(logprob_mode=[2, 0], logprobs=[-1.0, -2.0], top_counts=[1, 1],
         top_ids=[1], top_logprobs=[-1.0]),                           # too few alternatives
    dict(logprob_mode=[2, 0], logprobs=[-1.0, -2.0], top_counts=[1, 1],
         top_ids=[1, 2], top_logprobs=[-1.0]),                        # ids vs values
])
def test_inconsistent_logprobs_is_protocol_error(fields: dict) -> None:
    with pytest.raises(ProtocolError):
        decode(_tokens_frames(**fields))


def test_float_blob_of_bad_length_is_protocol_error() -> None:
    frames = _tokens_frames(logprob_mode=[1, 0], logprobs=[-1.0, -2.0])
    with pytest.raises(ProtocolError, match="float32"):
        decode(frames[:-1] + [frames[-1][:-1]])


@pytest.mark.parametrize("fields", [
    dict(logprob=[-1.0, -2.0]),                                 # one first token, one logprob
    dict(logprob=[-1.0], top_ids=[1]),                          # ids without values
    dict(logprob=[-1.0], top_ids=[1, 2], top_logprobs=[-1.0]),  # ids vs values
    dict(top_ids=[1], top_logprobs=[-1.0]),                     # top without a logprob
])
def test_inconsistent_kv_done_logprobs_is_protocol_error(fields: dict) -> None:
    head = {"v": p.PROTOCOL_VERSION, "type": "kv_done", "room": 1, "epoch": 0, "first_token": 3,
            "weight_version": "v"}
    frames = []
    for name, value in fields.items():
        head[name] = len(frames)
        frames.append(struct.pack(f"<{len(value)}{'i' if name == 'top_ids' else 'f'}", *value))
    with pytest.raises(ProtocolError):
        decode([orjson.dumps(head), *frames])


@pytest.mark.parametrize("values", [["x"], [True], [None]])
def test_encode_rejects_non_float_logprobs(values: list) -> None:
    msg = p.Tokens(rids=["r"], counts=[1], token_ids=[1], weight_versions=["v"], logprob_mode=[1],
                   logprobs=values)
    with pytest.raises(ProtocolError):
        encode(msg)


def test_kv_done_cached_tokens_defaults_to_0_and_refuses_what_is_no_count() -> None:
    head = {"v": p.PROTOCOL_VERSION, "type": "kv_done", "room": 1, "epoch": 0, "first_token": 3,
            "weight_version": "v"}
    assert decode([orjson.dumps(head)]).cached_tokens == 0          # a peer without the field
    assert decode([orjson.dumps(head | {"cached_tokens": 32})]).cached_tokens == 32
    for bad in (-1, "32", True, 1.5, None, [32]):
        with pytest.raises(ProtocolError, match="cached_tokens"):
            decode([orjson.dumps(head | {"cached_tokens": bad})])
