"""Tokens without logprobs (most of them) take a fast path through pack and unpack at
the router, per token; it must give what the general path gives."""
from __future__ import annotations

from zpd.wire.protocol import TokenPart, Tokens, decode, encode


def test_plain_parts_round_trip_without_logprob_fields() -> None:
    parts = [TokenPart("a", [1, 2], ["v", "v"]),
             TokenPart("b", [], [], {"type": "length", "length": 3}, {"completion_tokens": 3}),
             TokenPart("c", [7], ["w"])]
    msg = Tokens.pack(parts)
    assert msg.logprob_mode is None and msg.ids_counts is None and msg.logprobs is None
    assert msg.ends == {"b": {"finish": {"type": "length", "length": 3},
                              "meta": {"completion_tokens": 3}}}
    back = decode(encode(msg)).unpack()
    assert back == parts
    back[0].meta["x"] = 1                       # each unfinished part has a meta of its own
    assert back[2].meta == {}


def test_logprobs_of_one_part_among_plain_ones_are_kept() -> None:
    parts = [TokenPart("a", [1], ["v"]),
             TokenPart("b", [2, 3], ["v", "v"], logprobs=[-0.5, -0.25]),
             TokenPart("c", [4], ["v"], ids_logprobs=[[-1.0, -2.0]], logprobs=[-0.125])]
    back = decode(encode(Tokens.pack(parts))).unpack()
    assert back == parts
    assert back[0].logprobs is None and back[1].logprobs == [-0.5, -0.25]
