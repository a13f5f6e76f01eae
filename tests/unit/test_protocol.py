"""Codec tests: every type round-trips, every malformed class is a ProtocolError."""

from __future__ import annotations

import dataclasses
import struct

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engines.kv.layout import KVLayout
from engines.sampling_params import SamplingParams
from zpd.wire import protocol as p
from zpd.wire.payloads import AdoptedRequest, KvTimings
from zpd.wire.protocol import ProtocolError, decode, encode

LAYOUT = KVLayout(num_layers=2, page_size=16, num_kv_heads=2, head_dim=64, dtype="float16",
                  element_bytes=2)
TIMINGS = KvTimings(prefill_queue=1.5, prefill_forward=20.25, kv_dest_wait=0.0, kv_transfer=3)

SAMPLES: list[p.Message] = [
    p.Generate(rid="r1", input_ids=[1, 2, 3], sampling=SamplingParams(temperature=0.0, stop=("x",)),
               stream=True, room=(1 << 62) + 5, epoch=2, prefill="127.0.0.1:5000",
               decode="127.0.0.1:5001"),
    p.Generate(rid="r0", input_ids=[]),
    p.Hello(decode="127.0.0.1:5001", layout=LAYOUT, compat_hash="abc", session_id="h:1",
            pools=[[0, 1, 0x7F00_0000_0000], [1, 2, 2**64 - 4096]], num_pages=1024,
            weight_version="v0"),
    p.HelloAck(ok=False, layout=LAYOUT, compat_hash="abd", session_id="h:2", pools=[[0, 2, 1]],
               num_pages=8, weight_version="v1", reason="hash mismatch"),
    p.KvDest(room=7, epoch=0, rid="r1", page_ids=[0, 5, 2**31 - 1], aux_slot=3),
    p.KvDone(room=7, epoch=1, first_token=42, weight_version="v2", timings=TIMINGS),
    p.KvDone(room=7, epoch=0, first_token=42, weight_version="v2", logprob=[-0.25],
             top_ids=[42, 7], top_logprobs=[-0.25, -1.5]),
    p.KvFailed(room=7, epoch=1, status=504, reason="deadline"),
    p.Recompute(rid="r1", room=7, epoch=2, input_ids=[-(2**31), 0, 9],
                sampling=SamplingParams(seed=1)),
    p.Tokens(rids=["r1"], counts=[2], token_ids=[4, 5], weight_versions=["v1", "v2"],
             ends={"r1": {"finish": {"type": "length"}, "meta": {"prompt_tokens": 3}}}),
    p.Tokens(rids=["r1"], counts=[1], token_ids=[4], weight_versions=["v1"], first=True),
    p.Tokens(rids=["r1", "r2"], counts=[2, 0], token_ids=[4, 5], weight_versions=["v1", "v2"],
             ends={"r2": {"finish": {"type": "abort", "status_code": 499}, "meta": {}}}),
    p.Tokens(rids=["r1", "r2", "r3"], counts=[2, 1, 1], token_ids=[4, 5, 6, 7],
             weight_versions=["v1"] * 4, logprob_mode=[2, 0, 1], logprobs=[-0.5, -1.0, -2.0],
             top_counts=[1, 2], top_ids=[4, 5, 9], top_logprobs=[-0.5, -1.0, -3.0],
             ids_counts=[1, 0, 2], ids_logprobs=[-3.5, -4.0, -6.0, -7.0]),
    p.Accepted(rid="r1"),
    p.Accepted(rid="r1", boot="b", more=["r2", "r3"]),
    p.Tokens(rids=["r1", "r2"], counts=[1, 1], token_ids=[4, 5], weight_versions=["v1", "v1"],
             starts=[3, -1]),
    p.Abort(rid="r1"),
    p.Admin(command="pause", args={"mode": "retract"}, req_id="q1"),
    p.AdminReply(req_id="q1", ok=True, result={"paused": "retract"}),
    p.Resume(rid="r1", have=7),
    p.KvDone(room=7, epoch=0, first_token=42, weight_version="v2", logprob=[-0.25],
             top_ids=[42], top_logprobs=[-0.25], ids_logprobs=[-3.0], prompt_logprobs=[-1.0],
             prompt_top_ids=[3], prompt_top_logprobs=[-1.0], prompt_ids_logprobs=[-2.0],
             routed_experts=[bytes([0, 3]), bytes([1, 2])],
             routed_expert_weights=[struct.pack("<4f", 0.75, 0.25, 0.5, 0.5)]),
    p.Rows(rid="r1", dtype="uint8", ids=[bytes([0, 3, 1, 2])]),
    p.Rows(rid="r2", dtype="int16", ids=[bytes([0, 1]), bytes([2, 3])],
           weights=[struct.pack("<2f", 0.75, 0.25)]),
    p.Adopt(),
    p.Adopted(requests={"r1": AdoptedRequest(owner="6162", prefill="127.0.0.1:5000", stream=True,
                                               tokens=40, output=3)}, paused="retract"),
    p.Ping(seq=3, sent_at=12.5, sender="decode-0", boot="123.abcd"),
    p.Pong(seq=3, sent_at=12.5, sender="prefill-0"),
    p.Error(status=400, reason="bad", rid="r9"),
]


def header(frames: list[bytes]) -> dict:
    return orjson.loads(frames[0])


def without(frames: list[bytes], key: str) -> list[bytes]:
    return [orjson.dumps({k: v for k, v in header(frames).items() if k != key}), *frames[1:]]


def with_header(frames: list[bytes], **changes: object) -> list[bytes]:
    h = header(frames)
    h.update(changes)
    return [orjson.dumps(h), *frames[1:]]


def test_every_registered_type_has_a_sample() -> None:
    assert {type(m) for m in SAMPLES} == set(p.MESSAGE_TYPES.values())


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: m.TYPE)
def test_round_trip(msg: p.Message) -> None:
    frames = encode(msg)
    assert all(isinstance(f, bytes) for f in frames)
    assert header(frames)["v"] == p.PROTOCOL_VERSION
    assert header(frames)["type"] == msg.TYPE
    assert decode(frames) == msg


def test_defaults_fill_optional_fields() -> None:
    frames = [orjson.dumps({"v": p.PROTOCOL_VERSION, "type": "abort", "rid": "x"})]
    assert decode(frames) == p.Abort(rid="x", status=499, reason="")


def test_blob_is_little_endian_int32() -> None:
    frames = encode(p.KvDest(room=1, epoch=0, rid="r", page_ids=[1, -2, 0x01020304]))
    assert header(frames)["page_ids"] == 0
    assert frames[1] == struct.pack("<3i", 1, -2, 0x01020304)
    raw = struct.pack("<2i", 258, -1)
    msg = decode([orjson.dumps({"v": p.PROTOCOL_VERSION, "type": "kv_dest", "room": 1, "epoch": 0,
                                "rid": "r", "page_ids": 0}), raw])
    assert msg.page_ids == [258, -1]


def test_int_field_accepts_float_coerces_for_float() -> None:
    msg = decode(with_header(encode(SAMPLES[-3]), sent_at=3))
    assert msg.sent_at == 3.0 and type(msg.sent_at) is float


GOOD = encode(SAMPLES[0])
HELLO = encode(SAMPLES[2])
KV_DONE = encode(SAMPLES[5])
WIRE_LAYOUT = LAYOUT.to_dict()
WIRE_TIMINGS = TIMINGS.to_wire()
MALFORMED = {
    "empty": [],
    "not json": [b"\x00garbage"],
    "bad utf8": [b'{"v":2,"type":"\xff"}'],
    "not object": [b"[1, 2]"],
    "missing v": without(GOOD, "v"),
    "null v": with_header(GOOD, v=None),
    "wrong v": with_header(GOOD, v=p.PROTOCOL_VERSION + 1),
    "previous v (a peer not upgraded)": with_header(GOOD, v=p.PROTOCOL_VERSION - 1),
    "v as string": with_header(GOOD, v="1"),
    "v as bool": with_header(GOOD, v=True),
    "unknown type": with_header(GOOD, type="nope"),
    "type not str": with_header(GOOD, type=["generate"]),
    "missing type": without(GOOD, "type"),
    "missing field": without(GOOD, "rid"),
    "missing blob field": without(GOOD, "input_ids"),
    "str field int": with_header(GOOD, rid=5),
    "int field str": with_header(GOOD, room="5"),
    "int field bool": with_header(GOOD, epoch=True),
    "int field float": with_header(GOOD, room=1.5),
    "bool field int": with_header(GOOD, stream=1),
    "dict field list": with_header(GOOD, sampling=[1]),
    "non-optional null": with_header(GOOD, sampling=None),
    "blob index str": with_header(GOOD, input_ids="0"),
    "blob index list": with_header(GOOD, input_ids=[1, 2]),
    "blob index range": with_header(GOOD, input_ids=1),
    "blob index negative": with_header(GOOD, input_ids=-1),
    "blob index wraps to last": with_header(GOOD, input_ids=-2),
    "blob missing": GOOD[:1],
    "blob bad length": [GOOD[0], b"\x01\x02\x03\x04\x05"],
    "float field str": with_header(encode(SAMPLES[-3]), sent_at="now"),
    "str list has int": with_header(encode(SAMPLES[9]), weight_versions=["v1", 2]),
    "str list is str": with_header(encode(SAMPLES[9]), weight_versions="v1"),
    "dict field str": with_header(encode(SAMPLES[9]), ends="stop"),
    "bool field null": with_header(encode(SAMPLES[10]), first=None),
    "pools not a list": with_header(HELLO, pools=5),
    "pools row not a list": with_header(HELLO, pools=[5]),
    "pools hold a str": with_header(HELLO, pools=[[0, 1, "0x10"]]),
    "pools hold a bool": with_header(HELLO, pools=[[0, True, 16]]),
    "pools hold a float": with_header(HELLO, pools=[[0, 1, 16.0]]),
    # a peer on version 2 says hello with one base_addr: refused by its version
    "hello of version 2": with_header(without(HELLO, "pools"), v=2, base_addr=16),
    "hello without pools": without(HELLO, "pools"),
    "resume of a negative count": [orjson.dumps({"v": p.PROTOCOL_VERSION, "type": "resume",
                                                 "rid": "r1", "have": -1})],
    "layout not an object": with_header(HELLO, layout=[2, 16]),
    "layout without a field": with_header(HELLO, layout={k: v for k, v in WIRE_LAYOUT.items()
                                                          if k != "head_dim"}),
    "layout of no layers": with_header(HELLO, layout=WIRE_LAYOUT | {"num_layers": 0}),
    "layout with a bool": with_header(HELLO, layout=WIRE_LAYOUT | {"num_kv_heads": True}),
    "layout with a float": with_header(HELLO, layout=WIRE_LAYOUT | {"head_dim": 64.0}),
    "layout's dtype not a str": with_header(HELLO, layout=WIRE_LAYOUT | {"dtype": 2}),
    "layout's page_bytes not its fields'": with_header(HELLO, layout=WIRE_LAYOUT | {"page_bytes": 1}),
    "layout's order another": with_header(HELLO, layout=WIRE_LAYOUT | {"order": "page,kv"}),
    "hello_ack's layout": with_header(encode(SAMPLES[3]), layout=WIRE_LAYOUT | {"page_size": -16}),
    "timings not an object": with_header(KV_DONE, timings=5),
    "timings without a step": with_header(KV_DONE, timings={"prefill_queue": 1.0}),
    "timings negative": with_header(KV_DONE, timings=WIRE_TIMINGS | {"kv_transfer": -1.0}),
    "timings not a number": with_header(KV_DONE, timings=WIRE_TIMINGS | {"prefill_queue": "1"}),
    "timings null": with_header(KV_DONE, timings=WIRE_TIMINGS | {"kv_dest_wait": None}),
    "timings bool": with_header(KV_DONE, timings=WIRE_TIMINGS | {"kv_dest_wait": True}),
    "adopted requests not an object": [orjson.dumps({"v": p.PROTOCOL_VERSION, "type": "adopted",
                                                     "requests": [["r1"]]})],
}


@pytest.mark.parametrize("frames", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_is_protocol_error(frames: list[bytes]) -> None:
    with pytest.raises(ProtocolError) as exc:
        decode(frames)
    assert exc.value.reason


def test_unknown_header_keys_are_ignored() -> None:
    assert decode(with_header(GOOD, future_field=1)) == SAMPLES[0]
    assert decode(with_header(HELLO, layout=WIRE_LAYOUT | {"future": 1})) == SAMPLES[2]
    assert decode(with_header(KV_DONE, timings=WIRE_TIMINGS | {"future": 1})) == SAMPLES[5]


def test_records_travel_as_the_objects_of_version_4() -> None:
    """A layout, timings and adopted requests are objects in the header, as they were."""
    assert header(HELLO)["layout"] == {
        "num_layers": 2, "page_size": 16, "num_kv_heads": 2, "head_dim": 64, "dtype": "float16",
        "element_bytes": 2, "page_bytes": 2 * 2 * 16 * 2 * 64 * 2, "order": "page,layer,kv,token,head,dim"}
    assert header(KV_DONE)["timings"] == {"prefill_queue": 1.5, "prefill_forward": 20.25,
                                          "kv_dest_wait": 0.0, "kv_transfer": 3}
    assert header(encode(SAMPLES[-4]))["requests"] == {"r1": {
        "owner": "6162", "prefill": "127.0.0.1:5000", "stream": True, "tokens": 40, "output": 3,
        "routed": False}}
    assert "timings" not in header(encode(SAMPLES[6]))     # none: not sent


GOOD_ENTRY = {"owner": "6162", "prefill": "p:1", "stream": False, "tokens": 9, "output": 0}


@pytest.mark.parametrize("entry,named", [
    ([], "object"), (GOOD_ENTRY | {"owner": "zz"}, "owner"), (GOOD_ENTRY | {"owner": ""}, "owner"),
    (GOOD_ENTRY | {"prefill": ["x"]}, "prefill"), (GOOD_ENTRY | {"stream": 1}, "stream"),
    (GOOD_ENTRY | {"tokens": "9"}, "tokens"), (GOOD_ENTRY | {"output": -1}, "output"),
    (GOOD_ENTRY | {"routed": "yes"}, "routed"),
    ({k: v for k, v in GOOD_ENTRY.items() if k != "tokens"}, "tokens")])
def test_a_refused_adopted_entry_keeps_the_others_with_the_reason(entry, named) -> None:
    """Checked once, by the router's decode; the router aborts the refused rids."""
    frames = [orjson.dumps({"v": p.PROTOCOL_VERSION, "type": "adopted",
                            "requests": {"ok": GOOD_ENTRY, "bad": entry}})]
    msg = decode(frames)
    assert msg.requests == {"ok": AdoptedRequest("6162", "p:1", False, 9, 0)}
    assert set(msg.refused) == {"bad"} and named in msg.refused["bad"]
    assert decode(encode(msg)).refused == {}           # the reasons are never sent on


def test_sampling_travels_as_the_parameters_set() -> None:
    assert header(GOOD)["sampling"] == {"temperature": 0.0, "stop": ["x"]}
    assert header(encode(SAMPLES[1]))["sampling"] == {}


def test_an_old_peer_is_refused_by_its_version() -> None:
    with pytest.raises(ProtocolError, match=rf"version 4 \(want {p.PROTOCOL_VERSION}\)"):
        decode(with_header(GOOD, v=4))


@pytest.mark.parametrize("sampling,named", [({"temperature": -1}, "temperature"),
                                            ({"top_k": 2**63}, "top_k"),
                                            ({"bogus": 1}, "bogus"),
                                            ({"stop": [1]}, "stop"),
                                            ({"max_new_tokens": 0, "seed": "x"}, "seed")])
@pytest.mark.parametrize("sample", [0, 8], ids=["generate", "recompute"])
def test_refused_sampling_keeps_the_request_with_the_reason(sampling, named, sample) -> None:
    """Checked once, by the decode; the receiver answers the request with the reason."""
    msg = decode(with_header(encode(SAMPLES[sample]), sampling=sampling))
    assert named in msg.refused and msg.sampling == SamplingParams()
    assert msg.rid == SAMPLES[sample].rid and msg.input_ids == SAMPLES[sample].input_ids
    assert decode(encode(msg)).refused == ""          # the reason is never sent on


def test_a_refused_scoring_request_is_no_scoring_request() -> None:
    msg = decode(with_header(GOOD, sampling={"max_new_tokens": 0, "top_p": 0}))
    assert msg.refused.startswith("top_p") and not msg.scores_only
    assert decode(with_header(GOOD, sampling={"max_new_tokens": 0})).scores_only


@pytest.mark.parametrize("bad", [
    p.Generate(rid=1, input_ids=[1]),  # type: ignore[arg-type]
    p.Generate(rid="r", input_ids=[2**31]),
    p.Generate(rid="r", input_ids=["a"]),  # type: ignore[list-item]
    p.Abort(rid="r", status=True),
    p.Generate(rid="r", input_ids=[1], sampling={"temperature": 0}),  # type: ignore[arg-type]
    p.Hello("d", {"num_layers": 1}, "h", "s", [[0, 1, 16]], 1, "v"),  # type: ignore[arg-type]
    p.KvDone(1, 0, 5, "v", timings={"kv_transfer": 1.0}),  # type: ignore[arg-type]
    p.Adopted(requests={"r": {"owner": "61"}}),  # type: ignore[dict-item]
    p.Adopted(requests=[AdoptedRequest("61", "p", False, 1, 0)]),  # type: ignore[arg-type]
    p.Ping(seq=1, sent_at=float("nan")),
    p.Admin(command="c", args={"x": object()}),
    p.Tokens(rids=["r"], counts=[1], token_ids=[5], weight_versions=[1]),  # type: ignore[list-item]
])
def test_encode_rejects_bad_fields(bad: p.Message) -> None:
    with pytest.raises(ProtocolError):
        encode(bad)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats(allow_nan=False)
    | st.text(max_size=8),
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=8), kids, max_size=3),
    max_leaves=8,
)


VALID_BY_KIND = {
    "int": st.integers(-(2**63), 2**63 - 1), "float": st.floats(allow_nan=False),
    "str": st.text(max_size=8), "bool": st.booleans(),
    "dict": st.dictionaries(st.text(max_size=8), json_values, max_size=3),
    "strs": st.lists(st.text(max_size=8), max_size=3), "blob": st.integers(0, 6),
    "f32blob": st.integers(0, 6), "pieces": st.lists(st.integers(0, 6), min_size=2, max_size=2),
    "record": st.dictionaries(st.text(max_size=8), json_values, max_size=3),
    "records": st.dictionaries(st.text(max_size=8), st.dictionaries(st.text(max_size=8), json_values,
                                                                    max_size=5), max_size=3),
    "intlists": st.lists(st.lists(st.integers(0, 2**64 - 1), max_size=3), max_size=3),
}


@st.composite
def plausible_frames(draw: st.DrawFn) -> list[bytes]:
    """Headers that look like ours, each field usually well-typed but
    sometimes missing or random, so the fuzz reaches both decoded messages
    and every validation branch, not only the JSON parser."""
    cls = draw(st.sampled_from(list(p.MESSAGE_TYPES.values())))
    head: dict = {"v": draw(st.sampled_from([p.PROTOCOL_VERSION] * 8 + [0, "1"])), "type": cls.TYPE}
    for f in p._SPECS[cls]:
        choice = draw(st.integers(0, 9))
        if choice == 0:
            continue
        head[f.name] = draw(json_values if choice == 1 else VALID_BY_KIND[f.kind])
    blob = st.binary(max_size=16).map(lambda b: b[: len(b) - len(b) % 4]) | st.binary(max_size=9)
    return [orjson.dumps(head), *draw(st.lists(blob, min_size=0, max_size=7))]


def _decode_or_error(frames: list[bytes]) -> None:
    try:
        msg = decode(frames)
    except ProtocolError:
        return
    assert isinstance(msg, p.Message)
    # repr, not ==: a float32 blob of random bytes may hold NaN, which equals nothing
    assert repr(decode(encode(msg))) == repr(_as_sent(msg))


def _as_sent(msg: p.Message) -> p.Message:
    """`msg` without what its decode found (its refusals), which is never sent on."""
    local = {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
             for f in dataclasses.fields(msg) if not f.metadata.get("wire", True)}
    return dataclasses.replace(msg, **local)


@settings(max_examples=400, deadline=None)
@given(st.lists(st.binary(max_size=64), max_size=4))
def test_fuzz_random_bytes(frames: list[bytes]) -> None:
    _decode_or_error(frames)


@settings(max_examples=1000, deadline=None)
@given(plausible_frames())
def test_fuzz_plausible_headers(frames: list[bytes]) -> None:
    _decode_or_error(frames)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(-(2**31), 2**31 - 1), max_size=200), st.text(max_size=20))
def test_fuzz_round_trip_ids(ids: list[int], rid: str) -> None:
    msg = p.Recompute(rid=rid, room=1, epoch=1, input_ids=ids)
    assert decode(encode(msg)) == msg


def test_tokens_pack_unpack_keeps_every_part() -> None:
    parts = [p.TokenPart("a", [1, 2], ["v1", "v1"]),
             p.TokenPart("b", [], [], {"type": "abort", "status_code": 503}, {"x": 1}),
             p.TokenPart("c", [3], ["v2"], {"type": "length"}, {"prompt_tokens": 4})]
    got = decode(encode(p.Tokens.pack(parts)))
    assert got.unpack() == parts and not got.first
    assert [t.finished for t in got.unpack()] == [False, True, True]
    assert decode(encode(p.Tokens.pack(parts[:1], first=True))).first


def test_abort_answer_is_one_finished_part() -> None:
    got = decode(encode(p.Tokens.abort("r", 503, "gone", {"prompt_tokens": 2})))
    assert got.unpack() == [p.TokenPart("r", [], [], {"type": "abort", "status_code": 503,
                                                      "message": "gone"}, {"prompt_tokens": 2})]
    assert p.TokenPart.abort("r", 499, "x").finished


def test_new_room_is_a_positive_63_bit_int() -> None:
    rooms = {p.new_room() for _ in range(100)}
    assert len(rooms) == 100 and all(0 <= r < 2**63 for r in rooms)


@pytest.mark.parametrize("fields", [
    dict(rids=["a"], counts=[1, 1], token_ids=[1, 2], weight_versions=["v", "v"]),  # counts vs rids
    dict(rids=["a"], counts=[2], token_ids=[1], weight_versions=["v"]),             # too few ids
    dict(rids=["a"], counts=[1], token_ids=[1], weight_versions=["v", "w"]),        # versions vs ids
    dict(rids=["a", "a"], counts=[1, 0], token_ids=[1], weight_versions=["v"]),     # rid twice
    dict(rids=["a"], counts=[-1], token_ids=[], weight_versions=[]),
    dict(rids=["a"], counts=[1], token_ids=[1], weight_versions=["v"], ends={"b": {}}),
    dict(rids=["a"], counts=[1], token_ids=[1], weight_versions=["v"], ends={"a": 3}),
    dict(rids=["a"], counts=[1], token_ids=[1], weight_versions=["v"], ends={"a": {"meta": {}}}),
])
def test_inconsistent_tokens_is_protocol_error(fields: dict) -> None:
    header = {"v": p.PROTOCOL_VERSION, "type": "tokens", "rids": fields["rids"], "counts": 0,
              "token_ids": 1, "weight_versions": fields["weight_versions"],
              "ends": fields.get("ends", {})}
    frames = [orjson.dumps(header), struct_ids(fields["counts"]), struct_ids(fields["token_ids"])]
    with pytest.raises(ProtocolError):
        decode(frames)


def struct_ids(values: list[int]) -> bytes:
    return struct.pack(f"<{len(values)}i", *values)


def test_more_frames_than_any_message_has_is_protocol_error() -> None:
    # ZeroMQ bounds each frame, never their number: the codec refuses the surplus.
    frames = encode(p.Generate("r", [1, 2, 3]))
    assert len(frames) <= p.MAX_FRAMES
    with pytest.raises(ProtocolError, match="frames"):
        decode(frames + [b""] * (p.MAX_FRAMES + 1 - len(frames)))


def test_max_frames_is_header_plus_the_most_blobs_of_any_type() -> None:
    # kv_done: header, logprob, top_ids, top_logprobs, ids_logprobs, prompt_logprobs,
    # prompt_top_ids, prompt_top_logprobs, prompt_ids_logprobs, then routed_experts and
    # routed_expert_weights, MAX_PIECES frames each at most (tokens has 10: header,
    # counts, token_ids, logprob_mode, logprobs, top_counts, top_ids, top_logprobs,
    # ids_counts, ids_logprobs)
    assert p.MAX_PIECES == 32 and p.MAX_FRAMES == 9 + 2 * p.MAX_PIECES
    full = [b"\0"] * p.MAX_PIECES
    most = next(m for m in SAMPLES if isinstance(m, p.KvDone) and m.prompt_logprobs is not None)
    longest = encode(dataclasses.replace(most, routed_experts=full, routed_expert_weights=full))
    assert len(longest) == p.MAX_FRAMES
