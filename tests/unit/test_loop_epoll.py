"""The loop's waiting (zpd/wire/readiness.py): a wake-up reads ZMQ_EVENTS only of the
sockets that may be ready, and no message is left waiting for a timeout by ZMQ_FD's
edge: one arriving between a drain and the sleep, one whose edge a send took, more
than max_batch queued, a socket removed by its own handler, raw fds beside sockets.
The edge cases run on both waiters (epoll, and zmq.Poller: the old way)."""

from __future__ import annotations

import os
import select
import tempfile
import threading
import time
from collections.abc import Iterator

import pytest
import zmq

from zpd.wire import loop as loop_module
from zpd.wire import protocol as p
from zpd.wire import readiness
from zpd.wire.loop import Loop
from zpd.wire.net import Dealer, Router

WAITERS = ("epoll", "poll")
PATIENCE = 3.0        # a missed wake-up sleeps this long; a delivered one takes ~0


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


@pytest.fixture(params=WAITERS)
def lp(request: pytest.FixtureRequest) -> Iterator[Loop]:
    loop = Loop(max_poll=PATIENCE, max_batch=10, waiter=request.param)
    yield loop
    loop.close()


def pair(ctx: zmq.Context, name: str) -> tuple[Router, Dealer]:
    router = Router(ctx, f"inproc://{name}", 0)
    return router, Dealer(ctx, router.endpoint, identity=b"d")


def timed(loop: Loop, max_wait: float = PATIENCE) -> float:
    started = time.monotonic()
    loop.run_once(max_wait=max_wait)
    return time.monotonic() - started


def fd_readable(sock: zmq.Socket) -> bool:
    return bool(select.select([sock.getsockopt(zmq.FD)], [], [], 0)[0])


def test_a_message_arriving_after_the_drain_wakes_the_sleep(ctx: zmq.Context, lp: Loop) -> None:
    router, dealer = pair(ctx, f"late-{lp._waiter.__class__.__name__}")
    got: list[object] = []
    lp.add_socket(router, lambda: got.append(router.recv()))
    dealer.send(p.Abort(rid="first"))
    assert timed(lp) < 1.0 and len(got) == 1        # drained: its ZMQ_EVENTS say empty now
    # A timer runs after the drains of its iteration: what it causes to arrive must wake
    # the next sleep, not wait for max_wait.
    lp.call_later(0, dealer.send, p.Abort(rid="second"))
    lp.run_once(max_wait=0)
    assert len(got) == 1
    assert timed(lp) < 1.0
    assert [m for _, m in got] == [p.Abort(rid="first"), p.Abort(rid="second")]


def test_a_send_that_takes_the_edge_does_not_strand_the_message(ctx: zmq.Context, lp: Loop) -> None:
    """The loop watches a DEALER; a message for it arrives, then the DEALER sends
    (libzmq processes the socket's commands in the send, clearing ZMQ_FD) before the
    loop looks: the message must still be dispatched without waiting."""
    router, dealer = pair(ctx, f"edge-{lp._waiter.__class__.__name__}")
    got: list[object] = []
    lp.add_socket(dealer, lambda: got.append(dealer.recv()))
    dealer.send(p.Ping(seq=0, sent_at=0.0))           # connect: the router learns "d"
    assert router.recv(timeout=1.0) is not None
    lp.run_once(max_wait=0)                           # settled: fd quiet, nothing to read
    taken = 0
    for seq in range(1, 6):
        router.send(b"d", p.Pong(seq=seq, sent_at=0.0))
        time.sleep(0.01)                              # past libzmq's command throttle
        dealer.send(p.Ping(seq=seq, sent_at=0.0))     # this send processes "ready to read"
        taken += not fd_readable(dealer.socket)
        assert timed(lp) < 1.0
        assert [m.seq for m in got] == list(range(1, seq + 1))
    assert taken > 0     # the case is real: at least one send left the fd quiet


def test_a_bare_socket_and_touch_after_use_elsewhere(ctx: zmq.Context, lp: Loop) -> None:
    """A zmq.Socket (no wrapper to report its sends) and a socket another party read
    the events of (Loop.touch): neither strands a message."""
    router, dealer = pair(ctx, f"bare-{lp._waiter.__class__.__name__}")
    bare = dealer.socket
    got: list[list[bytes]] = []
    lp.add_socket(bare, lambda: got.append(bare.recv_multipart()))
    dealer.send(p.Ping(seq=0, sent_at=0.0))
    assert router.recv(timeout=1.0) is not None
    lp.run_once(max_wait=0)
    router.send(b"d", p.Pong(seq=1, sent_at=0.0))
    time.sleep(0.01)
    bare.send_multipart(p.encode(p.Ping(seq=1, sent_at=0.0)))   # unseen by the loop
    assert timed(lp) < 1.0 and len(got) == 1
    wrapped_router, wrapped = pair(ctx, f"touch-{lp._waiter.__class__.__name__}")
    lp.add_socket(wrapped, lambda: got.append(wrapped.recv()))
    wrapped.send(p.Ping(seq=0, sent_at=0.0))
    assert wrapped_router.recv(timeout=1.0) is not None
    lp.run_once(max_wait=0)
    wrapped_router.send(b"d", p.Pong(seq=2, sent_at=0.0))
    time.sleep(0.01)
    assert wrapped.socket.getsockopt(zmq.EVENTS) & zmq.POLLIN   # someone else looked
    lp.touch(wrapped)
    assert timed(lp) < 1.0 and len(got) == 2


def test_more_than_max_batch_keeps_flowing_without_a_new_edge(ctx: zmq.Context, lp: Loop) -> None:
    router, dealer = pair(ctx, f"batch-{lp._waiter.__class__.__name__}")
    got: list[int] = []
    lp.add_socket(router, lambda: got.append(router.recv()[1].seq))
    for i in range(25):
        dealer.send(p.Ping(seq=i, sent_at=0.0))
    assert timed(lp) < 1.0 and got == list(range(10))     # bounded per iteration
    assert timed(lp) < 1.0 and got == list(range(20))     # the rest: no sleep between
    assert timed(lp) < 1.0 and got == list(range(25))
    assert timed(lp, 0.2) >= 0.15                          # then idle: it sleeps


def test_a_socket_removed_in_a_handler(ctx: zmq.Context, lp: Loop) -> None:
    """By its own handler (the rest of its queue is not dispatched), and another socket
    ready in the same iteration removed by the first one's handler."""
    tag = lp._waiter.__class__.__name__
    r1, d1 = pair(ctx, f"rm1-{tag}")
    r2, d2 = pair(ctx, f"rm2-{tag}")
    got: list[str] = []

    def on_r1() -> None:
        got.append(r1.recv()[1].rid)
        lp.remove_socket(r1)
        lp.remove_socket(r2)
    lp.add_socket(r1, on_r1)
    lp.add_socket(r2, lambda: got.append(r2.recv()[1].rid))
    for rid in ("a", "b", "c"):
        d1.send(p.Abort(rid=rid))
    time.sleep(0.01)
    lp.run_once(max_wait=0)          # r2 idle: r1's handler runs first, removing both
    for rid in ("x", "y"):
        d2.send(p.Abort(rid=rid))
    d1.send(p.Abort(rid="d"))
    assert timed(lp, 0.2) >= 0.15    # nothing watched but the wake-up pipe
    assert got == ["a"]
    assert r1.touched is None and r2.touched is None
    lp.add_socket(r1, lambda: got.append(r1.recv()[1].rid))   # watched again: its backlog
    assert timed(lp) < 1.0
    assert got == ["a", "b", "c", "d"]


def test_fd_handlers_beside_sockets(ctx: zmq.Context, lp: Loop) -> None:
    router, dealer = pair(ctx, f"fd-{lp._waiter.__class__.__name__}")
    r, w = os.pipe()
    got: list[object] = []

    def on_pipe() -> None:
        got.append(os.read(r, 100))
        lp.remove_fd(r)              # removed by its own handler

    lp.add_fd(r, on_pipe)
    lp.add_socket(router, lambda: got.append(router.recv()[1].rid))
    try:
        os.write(w, b"pipe")
        dealer.send(p.Abort(rid="sock"))
        time.sleep(0.01)
        assert timed(lp) < 1.0
        assert sorted(map(str, got)) == ["b'pipe'", "sock"]   # one iteration, both
        os.write(w, b"again")
        assert timed(lp, 0.2) >= 0.15 and len(got) == 2    # removed: not called
        with tempfile.TemporaryFile() as f:   # epoll refuses a file; poll calls it readable
            calls: list[int] = []
            lp.add_fd(f.fileno(), lambda: calls.append(1))
            assert timed(lp) < 1.0 and calls == [1]
            lp.remove_fd(f.fileno())
    finally:
        os.close(r)
        os.close(w)


def test_a_wake_up_reads_the_events_of_the_ready_socket_only(
        ctx: zmq.Context, monkeypatch: pytest.MonkeyPatch) -> None:
    """81 idle sockets and one that gets a message: the epoll waiter reads ZMQ_EVENTS a
    few times (the fired socket's), zmq.Poller reads all 82."""
    reads = [0]
    real = readiness.readable

    def counting(sock: zmq.Socket) -> bool:
        reads[0] += 1
        return real(sock)
    monkeypatch.setattr(readiness, "readable", counting)
    monkeypatch.setattr(loop_module, "readable", counting)
    lp = Loop(waiter="epoll")
    lp._waiter.sweep_s = 3600.0                # no sweep (every socket) in the window
    lp._waiter._sweep_at = time.monotonic() + 3600.0
    pairs = [pair(ctx, f"many{i}") for i in range(82)]
    try:
        for router, _ in pairs:
            lp.add_socket(router, router.recv)
        lp.run_once(max_wait=0)              # the first look at each (added: maybe ready)
        lp.run_once(max_wait=0.05)           # idle: a sleep that reads nothing
        reads[0] = 0
        assert timed(lp, 0.1) >= 0.05 and reads[0] == 0
        pairs[40][1].send(p.Abort(rid="one"))
        assert timed(lp) < 1.0
        assert 1 <= reads[0] <= 3            # the message, then "no more"
        assert pairs[40][0].socket.getsockopt(zmq.EVENTS) & zmq.POLLIN == 0
    finally:
        lp.close()


def test_unknown_waiter_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="unknown waiter 'kqueue'"):
        Loop(waiter="kqueue")


def _echo(ctx: zmq.Context, router: Router, stop: list[bool]) -> None:
    """A peer thread: answer every Ping on `router` with a Pong of the same seq."""
    while not stop[0]:
        got = router.recv(timeout=0.05)
        if got is not None:
            router.send(got[0], p.Pong(seq=got[1].seq, sent_at=0.0))


def test_a_relay_under_load_strands_nothing(ctx: zmq.Context, lp: Loop) -> None:
    """The router's pattern: a client's Pings in at a ROUTER (inproc: what the loop
    sends the client can read at once), out through DEALERs over TCP (each sends and
    receives: sends that take edges) to echoing peer threads, Pongs back; max_batch 10
    leaves messages behind. With answers owed, no turn may sleep its wait out."""
    lp.max_poll = 30.0
    front = Router(ctx, f"inproc://relay-{lp._waiter.__class__.__name__}", 0)
    peers = [Router(ctx, "127.0.0.1", 0) for _ in range(3)]
    links = [Dealer(ctx, peer.endpoint, identity=b"relay") for peer in peers]
    stop = [False]
    threads = [threading.Thread(target=_echo, args=(ctx, peer, stop)) for peer in peers]
    client = Dealer(ctx, front.endpoint, identity=b"client")
    asked: dict[int, bytes] = {}

    def on_front() -> None:
        got = front.recv()
        if got is not None:
            asked[got[1].seq] = got[0]
            links[got[1].seq % len(links)].send(got[1])

    def on_link(link: Dealer) -> None:
        msg = link.recv()
        if msg is not None:
            front.send(asked.pop(msg.seq), msg)

    lp.add_socket(front, on_front)
    for link in links:
        lp.add_socket(link, lambda link=link: on_link(link))
    for t in threads:
        t.start()
    try:
        total, window, sent, seen, stalls = 3000, 64, 0, set(), 0
        deadline = time.monotonic() + 20
        while len(seen) < total and time.monotonic() < deadline:
            while sent < total and sent - len(seen) < window:
                client.send(p.Ping(seq=sent, sent_at=0.0))
                sent += 1
            stalls += timed(lp, 2.0) >= 1.0   # answers owed, yet it slept its wait out
            while (got := client.recv(timeout=0)) is not None:
                seen.add(got.seq)
        assert stalls == 0
        assert len(seen) == total and not asked
    finally:
        stop[0] = True
        for t in threads:
            t.join()
        for s in (client, front, *links, *peers):
            s.close()
