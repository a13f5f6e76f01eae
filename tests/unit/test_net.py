"""Router/Dealer over real loopback sockets."""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Iterator

import pytest
import zmq

from engines.sampling_params import SamplingParams
from zpd.wire import protocol as p
from zpd.wire.net import Curve, Dealer, Router, SocketOptions, format_endpoint, parse_endpoint

WAIT = 5.0  # generous: a loaded CI box, never reached when things work


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    context = zmq.Context()
    yield context
    context.destroy(linger=0)       # term() would hang on a socket a failed test left open


@pytest.fixture
def pair(ctx: zmq.Context) -> Iterator[tuple[Router, Dealer]]:
    router = Router(ctx, "127.0.0.1", 0)
    dealer = Dealer(ctx, router.endpoint, identity=b"decode-0")
    yield router, dealer
    dealer.close()
    router.close()


def test_port_zero_picks_a_free_port(ctx: zmq.Context) -> None:
    a, b = Router(ctx, "127.0.0.1", 0), Router(ctx, "127.0.0.1", 0)
    try:
        host_a, port_a = parse_endpoint(a.endpoint)
        assert host_a == "127.0.0.1" and port_a > 0
        assert parse_endpoint(b.endpoint)[1] not in (0, port_a)
        with pytest.raises(zmq.ZMQError):  # really bound: the port is taken
            Router(ctx, "127.0.0.1", port_a)
    finally:
        a.close()
        b.close()


def test_binds_only_the_given_interface(ctx: zmq.Context) -> None:
    router = Router(ctx, "127.0.0.1", 0)
    port = parse_endpoint(router.endpoint)[1]
    try:
        # Linux routes all of 127/8 to lo; a wildcard bind would accept this.
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.2", port), timeout=WAIT).close()
        socket.create_connection(("127.0.0.1", port), timeout=WAIT).close()
    finally:
        router.close()


def test_round_trip_both_directions(pair: tuple[Router, Dealer]) -> None:
    router, dealer = pair
    sent = p.Generate(rid="r1", input_ids=[1, 2, 3], sampling=SamplingParams(temperature=0.0))
    assert dealer.send(sent)
    got = router.recv(timeout=WAIT)
    assert got == (b"decode-0", sent)
    reply = p.Tokens.pack([p.TokenPart(rid="r1", token_ids=[7], weight_versions=["v0"])])
    assert router.send(got[0], reply)
    assert dealer.recv(timeout=WAIT) == reply


def test_recv_without_message_returns_none(pair: tuple[Router, Dealer]) -> None:
    router, dealer = pair
    assert router.recv() is None
    started = time.monotonic()
    assert dealer.recv(timeout=0.05) is None
    assert time.monotonic() - started >= 0.04


def test_garbage_is_dropped_logged_and_next_message_arrives(
        ctx: zmq.Context, pair: tuple[Router, Dealer], caplog: pytest.LogCaptureFixture) -> None:
    router, _ = pair
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.IDENTITY, b"evil-peer")
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(f"tcp://{router.endpoint}")
    try:
        v = p.PROTOCOL_VERSION
        garbage = [[b"\xff\x00not json"], [b'{"v":9,"type":"ping"}'],
                   [b'{"v":%d,"type":"bogus"}' % v],
                   [b'{"v":%d,"type":"kv_dest","room":1,"epoch":0,"rid":"r","page_ids":3}' % v]]
        for frames in garbage:
            raw.send_multipart(frames)
        good = p.Ping(seq=1, sent_at=0.5, sender="evil")
        raw.send_multipart(p.encode(good))
        with caplog.at_level(logging.WARNING, logger="zpd.wire.net"):
            results = [router.recv(timeout=WAIT) for _ in range(len(garbage) + 1)]
    finally:
        raw.close()
    assert results[:-1] == [None] * len(garbage)
    assert results[-1] == (b"evil-peer", good)
    assert router.bad_messages == len(garbage)
    drops = [r for r in caplog.records if r.name == "zpd.wire.net" and "malformed" in r.getMessage()]
    assert len(drops) == len(garbage)
    assert all("evil-peer" in r.getMessage() for r in drops)
    assert "out of range" in drops[-1].getMessage()


def test_send_to_unknown_peer_is_dropped_not_raised(
        pair: tuple[Router, Dealer], caplog: pytest.LogCaptureFixture) -> None:
    router, _ = pair
    with caplog.at_level(logging.WARNING, logger="zpd.wire.net"):
        assert router.send(b"nobody", p.Abort(rid="x")) is False
    assert router.dropped_sends == 1
    assert any("nobody" in r.getMessage() for r in caplog.records)


def test_send_to_dead_peer_never_blocks(ctx: zmq.Context) -> None:
    # Nothing listens on this port: the DEALER queues up to its HWM, then
    # every further send is dropped at once instead of blocking.
    probe = Router(ctx, "127.0.0.1", 0)
    endpoint = probe.endpoint
    probe.close()
    dealer = Dealer(ctx, endpoint, opts=SocketOptions(hwm=10))
    try:
        started = time.monotonic()
        results = [dealer.send(p.Ping(seq=i, sent_at=0.0)) for i in range(100)]
        assert time.monotonic() - started < 1.0
        assert results.count(False) >= 80 and dealer.dropped_sends == results.count(False)
    finally:
        dealer.close()


def test_router_send_to_disconnected_peer(ctx: zmq.Context, pair: tuple[Router, Dealer]) -> None:
    router, _ = pair
    other = Dealer(ctx, router.endpoint, identity=b"short-lived")
    assert other.send(p.Ping(seq=1, sent_at=0.0))
    identity, _ = router.recv(timeout=WAIT)
    assert router.send(identity, p.Pong(seq=1, sent_at=0.0))
    other.close()
    deadline = time.monotonic() + WAIT
    while router.send(identity, p.Pong(seq=2, sent_at=0.0)):  # until zmq sees the close
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert router.dropped_sends >= 1


def test_endpoint_helpers() -> None:
    assert parse_endpoint("127.0.0.1:5000") == ("127.0.0.1", 5000)
    assert parse_endpoint("tcp://[::1]:80") == ("::1", 80)
    assert format_endpoint("::1", 80) == "[::1]:80"
    for bad in ("nohost", ":80", "h:", "h:x"):
        with pytest.raises(ValueError):
            parse_endpoint(bad)


def test_ipv6_loopback(ctx: zmq.Context) -> None:
    try:
        router = Router(ctx, "::1", 0)
    except zmq.ZMQError:
        pytest.skip("no IPv6 loopback here")
    dealer = Dealer(ctx, router.endpoint)
    try:
        assert router.endpoint.startswith("[::1]:")
        dealer.send(p.Ping(seq=1, sent_at=1.0))
        assert router.recv(timeout=WAIT)[1] == p.Ping(seq=1, sent_at=1.0)
    finally:
        dealer.close()
        router.close()


@pytest.mark.skipif(not zmq.has("curve"), reason="libzmq built without CURVE")
def test_curve_encrypted_pair(ctx: zmq.Context) -> None:
    server_pub, server_sec = zmq.curve_keypair()
    client_pub, client_sec = zmq.curve_keypair()
    router = Router(ctx, "127.0.0.1", 0, SocketOptions(curve=Curve(server_pub, server_sec)))
    good = Dealer(ctx, router.endpoint, opts=SocketOptions(
        curve=Curve(client_pub, client_sec, server_public=server_pub)))
    plain = Dealer(ctx, router.endpoint)  # no keys: the handshake must fail
    try:
        plain.send(p.Ping(seq=0, sent_at=0.0))
        good.send(p.Ping(seq=1, sent_at=0.0))
        assert router.recv(timeout=WAIT)[1] == p.Ping(seq=1, sent_at=0.0)
        assert router.recv(timeout=0.2) is None
    finally:
        plain.close()
        good.close()
        router.close()


def test_client_reads_batched_tokens_in_order(ctx: zmq.Context) -> None:
    """A `Tokens` message (a decode step's worth) reaches the caller as one chunk per
    request, in order, across receive() and stream()."""
    from zpd.client import Client
    router = Router(ctx, "127.0.0.1", 0)
    client = Client(router.endpoint, timeout=WAIT)
    try:
        rid = client.submit(input_ids=[1, 2], rid="a", stream=True)
        identity, msg = router.recv(timeout=WAIT)
        assert isinstance(msg, p.Generate) and msg.rid == rid
        router.send(identity, p.Accepted(rid))
        router.send(identity, p.Tokens.pack([p.TokenPart("a", [7], ["v1"]),
                                             p.TokenPart("b", [8, 9], ["v1", "v1"])]))
        router.send(identity, p.Tokens.pack([p.TokenPart("b", [], [], {"type": "length"}, {"n": 2}),
                                             p.TokenPart("a", [6], ["v2"], {"type": "stop"})]))
        got = [client.receive() for _ in range(4)]
        assert [(c["rid"], c["token_ids"], c["finished"]) for c in got] == [
            ("a", [7], False), ("b", [8, 9], False), ("b", [], True), ("a", [6], True)]
        assert got[2]["meta"] == {"n": 2} and got[3]["finish_reason"] == {"type": "stop"}
    finally:
        client.close()
        router.close()


def _raw_dealer(ctx: zmq.Context, endpoint: str, identity: bytes) -> zmq.Socket:
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.IDENTITY, identity)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(f"tcp://{endpoint}")
    return raw


def test_message_with_too_many_frames_is_dropped(
        ctx: zmq.Context, pair: tuple[Router, Dealer], caplog: pytest.LogCaptureFixture) -> None:
    router, _ = pair
    raw = _raw_dealer(ctx, router.endpoint, b"many-frames")
    good = p.Ping(seq=2, sent_at=0.5, sender="x")
    try:
        raw.send_multipart(p.encode(good) + [b"x"] * 1000)
        raw.send_multipart(p.encode(good))
        with caplog.at_level(logging.WARNING, logger="zpd.wire.net"):
            results = [router.recv(timeout=WAIT) for _ in range(2)]
    finally:
        raw.close()
    assert results == [None, (b"many-frames", good)]
    assert router.bad_messages == 1
    assert any("frames" in r.getMessage() for r in caplog.records)


def test_bound_router_refuses_a_frame_past_the_protocol_bound(ctx: zmq.Context) -> None:
    # The ceiling a stranger can make a bound socket allocate per frame (4 x 200 MiB
    # frames once took a router to 1.28 GB); the peer's connection is closed.
    assert SocketOptions().max_msg_bytes == p.MAX_FRAME_BYTES == 16 << 20
    router = Router(ctx, "127.0.0.1", 0)
    big, small = _raw_dealer(ctx, router.endpoint, b"big"), _raw_dealer(ctx, router.endpoint, b"ok")
    ping = p.Ping(seq=3, sent_at=0.5)
    try:
        big.send_multipart([p.encode(ping)[0], b"\0" * (p.MAX_FRAME_BYTES + 1)])
        small.send_multipart(p.encode(ping))
        assert router.recv(timeout=WAIT) == (b"ok", ping)
        assert router.recv(timeout=0.5) is None
    finally:
        big.close()
        small.close()
        router.close()


def test_dealer_takes_a_large_answer_from_the_peer_it_dialled(ctx: zmq.Context) -> None:
    # A decode step's Tokens carry the final texts of every request that ended in it:
    # the side that only hears its own peer keeps room for them.
    router = Router(ctx, "127.0.0.1", 0)
    dealer = Dealer(ctx, router.endpoint, identity=b"d")
    try:
        dealer.send(p.Ping(seq=1, sent_at=0.0))
        assert router.recv(timeout=WAIT) is not None
        text = "x" * (p.MAX_FRAME_BYTES + 1)
        msg = p.Tokens(["r"], [1], [7], ["v"], {"r": {"finish": {"type": "stop"}, "meta": {"text": text}}})
        router.send(b"d", msg)
        assert dealer.recv(timeout=WAIT) == msg
    finally:
        dealer.close()
        router.close()
