"""BusyResponder: pings answered during a long call on the scheduler thread, every
other message kept in order for after it, short calls left alone."""
from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import zmq

from zpd.wire import protocol as p
from zpd.worker.busy import BusyResponder
from zpd.wire.net import Dealer, Router

WAIT = 5.0


@pytest.fixture
def sockets() -> Iterator[tuple[Router, Dealer]]:
    ctx = zmq.Context()
    router = Router(ctx, "127.0.0.1", 0)
    dealer = Dealer(ctx, router.endpoint, identity=b"router-0")
    yield router, dealer
    dealer.close()
    router.close()
    ctx.term()


def _answer_pings(router: Router, answered: list[float]):
    def answer(identity: bytes, msg: p.Message) -> bool:
        if not isinstance(msg, p.Ping):
            return False
        answered.append(time.monotonic())
        router.send(identity, p.Pong(msg.seq, msg.sent_at, "w"))
        return True
    return answer


def test_long_call_answers_pings_and_keeps_the_rest_in_order(sockets) -> None:
    router, dealer = sockets
    answered: list[float] = []
    responder = BusyResponder(router, _answer_pings(router, answered), after_s=0.05)
    try:
        dealer.send(p.Ping(1, 0.0, "r"))         # queued before the call, answered in it
        time.sleep(0.1)
        start = time.monotonic()
        with responder.busy():
            dealer.send(p.Abort("a"))
            dealer.send(p.Ping(2, 0.0, "r"))
            dealer.send(p.Abort("b"))
            pongs = [dealer.recv(timeout=WAIT), dealer.recv(timeout=WAIT)]   # inside the call
            inside = time.monotonic()
            time.sleep(0.1)
        assert [m.seq for m in pongs] == [1, 2] and all(isinstance(m, p.Pong) for m in pongs)
        assert inside - start < 1.0 and len(answered) == 2
        assert [m.rid for _, m in responder.backlog] == ["a", "b"]
        assert responder.served_calls == 1
        assert router.recv() is None             # the socket is the scheduler's again, empty
    finally:
        responder.close()


def test_short_calls_leave_the_socket_alone(sockets) -> None:
    router, dealer = sockets
    answered: list[float] = []
    responder = BusyResponder(router, _answer_pings(router, answered), after_s=0.5)
    try:
        dealer.send(p.Ping(1, 0.0, "r"))
        time.sleep(0.05)
        for _ in range(50):
            with responder.busy():
                time.sleep(0.001)
        assert responder.served_calls == 0 and not answered and not responder.backlog
        got = router.recv(timeout=WAIT)           # still in the socket, for the loop
        assert got is not None and isinstance(got[1], p.Ping)
    finally:
        responder.close()


def test_after_s_must_be_positive(sockets) -> None:
    with pytest.raises(ValueError):
        BusyResponder(sockets[0], lambda i, m: False, after_s=0)
