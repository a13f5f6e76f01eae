"""The router's relay of a worker's steps (zpd/router/relay.py, zpd/wire/step.py): a
decode's tokens pass to their client unread when every rid of a body is that client's
and that decode's; anything else is settled part by part, and what its sender may not
send goes nowhere. Clients drop what they have already (each part says where it starts)."""
from __future__ import annotations

from tests.unit.inproc import InprocCluster, reference, send_raw
from zpd.wire.net import Dealer
from zpd.wire.protocol import Accepted, Generate, ProtocolError, TokenPart, Tokens, encode
from zpd.wire.resume import Resumes
from zpd.wire.step import bodies, decode_any, header_of, pack_step, peek

PROMPT = [5, 17, 99, 3, 42, 7, 250, 1]


def running(c: InprocCluster, rid: str) -> None:
    c.until(lambda: rid in c.decode.scheduler.by_rid and c.router.inflight[rid].from_decode > 1)


def test_decode_steps_pass_unread_and_each_token_is_counted_once(cluster):
    streamed = cluster.submit(PROMPT, 12)
    whole = cluster.submit(PROMPT[2:], 6, stream=False)
    assert cluster.run(streamed).token_ids == reference(cluster, PROMPT, 12)
    assert cluster.run(whole).token_ids == reference(cluster, PROMPT[2:], 6)
    relay = cluster.router.relayer
    assert relay.fast > 0 and relay.slow == 0
    assert cluster.router.tally.generation_tokens == 18        # the early token once
    assert not cluster.router.inflight
    assert [w.load for w in cluster.router.workers] == [0, 0]
    cluster.check_pages()


def forge(c: InprocCluster, sender, parts: list[TokenPart]) -> None:
    """`sender` (a worker core) sends the router a step of `parts`, one body."""
    sender.sock.send_frames(c.router.identity, pack_step([Tokens.pack(parts)]))


def test_tokens_only_from_the_decode_that_answers_and_only_to_their_client(cluster):
    mine = cluster.submit(PROMPT, 12)
    other = Dealer(cluster.ctx, cluster.router.endpoint, identity=b"other")
    send_raw(other, Generate("theirs", PROMPT[1:], stream=True),
             {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True})
    running(cluster, mine)
    running(cluster, "theirs")
    # the prefill does not answer `mine`: its step is settled part by part and dropped
    forge(cluster, cluster.prefill, [TokenPart(mine, [7, 7], ["x", "x"], start=10_000)])
    cluster.pump(2)
    assert cluster.router.relayer.slow == 1
    # the decode answers both, but one body may hold one client's rids only: the slow
    # way sends each part to its own client, never `theirs` to "client"
    seen = cluster.router.relayer.slow
    forge(cluster, cluster.decode, [TokenPart("theirs", [9], ["x"], start=10_000),
                                    TokenPart(mine, [], [], start=10_000)])
    cluster.pump(2)
    assert cluster.router.relayer.slow == seen + 1
    assert "theirs" not in cluster.answers
    assert cluster.run(mine).token_ids == reference(cluster, PROMPT, 12)
    other.close()


def test_a_malformed_step_is_dropped_and_counted(cluster):
    rid = cluster.submit(PROMPT, 8)
    running(cluster, rid)
    decode = next(w for w in cluster.router.workers if w.role == "decode")
    bad = decode.dealer.bad_messages
    good = pack_step([Tokens.pack([TokenPart(rid, [1], ["x"], start=0)])])
    for frames in ([good[0][:-3]], [good[0], *good[1:-1]], [good[0], b"{}", *good[2:]]):
        cluster.decode.sock.send_frames(cluster.router.identity, frames)
    cluster.pump(2)
    assert decode.dealer.bad_messages == bad + 3
    assert cluster.run(rid).token_ids == reference(cluster, PROMPT, 8)


def test_step_codec():
    a = Tokens.pack([TokenPart("a", [1, 2], ["v", "v"], start=3),
                     TokenPart("b", [], [], {"type": "stop"}, {"text": "x"}, start=0)])
    b = Tokens.pack([TokenPart("c", [4], ["v"], start=0)])
    frames = pack_step([a, b])
    got = bodies(header_of(frames[0]), frames)
    assert [len(body) for body in got] == [len(encode(a)), len(encode(b))]
    seen = peek(got[0])
    assert (seen.rids, seen.counts, list(seen.ends), seen.tokens) == (["a", "b"], [2, 0], ["b"], 2)
    merged = decode_any(frames)
    assert [(p.rid, p.token_ids, p.start) for p in merged.unpack()] == \
        [("a", [1, 2], 3), ("b", [], 0), ("c", [4], 0)]
    for bad in ([frames[0]] + frames[1:-1], [frames[0].replace(b"step", b"stop")] + frames[1:]):
        try:
            decode_any(bad)
        except ProtocolError:
            continue
        raise AssertionError("a malformed step decoded")
    for starts in ([0, 1], [-2]):
        try:
            Tokens(rids=["a"], counts=[0], token_ids=[], weight_versions=[], starts=starts)
        except ProtocolError:
            continue
        raise AssertionError(f"starts {starts} taken")


def test_a_client_drops_the_tokens_it_has():
    r = Resumes()
    r.opened("a", 0.0)
    assert r.got(TokenPart("a", [5], ["v"], start=0)).token_ids == [5]        # the early token
    assert r.got(TokenPart("a", [5, 6], ["v", "v"], start=0)).token_ids == [6]  # again, and more
    assert r.got(TokenPart("a", [6], ["v"], start=1)) is None
    end = r.got(TokenPart("a", [6, 7], ["v", "v"], {"type": "stop"}, start=1))
    assert end.token_ids == [7] and end.start == 2 and end.finished and "a" not in r.open


def test_one_accepted_for_the_generates_read_in_one_go(cluster):
    accepted = []
    decode = cluster.client._decode

    def counting(frames, peer):
        msg = decode(frames, peer)
        if isinstance(msg, Accepted):
            accepted.append(msg)
        return msg

    cluster.client._decode = counting
    rids = [cluster.submit(PROMPT[i:], 3, stream=False) for i in range(3)]
    for rid in rids:
        cluster.run(rid)
    assert sorted(r for msg in accepted for r in msg.rids) == sorted(rids)
    assert len(accepted) == 1 and cluster.accepted >= set(rids)
