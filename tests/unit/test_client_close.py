"""zpd.Client.close never hangs: not with a socket still open in its context, not when
called twice, and not when an unclosed Client is left to the garbage collector (which
once wedged a whole pytest run in zmq.Context.__del__ -> term).

Each close or collection runs in a daemon thread joined with a timeout, so a
regression fails here instead of hanging the suite."""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Callable, Iterator

import pytest
import zmq

from zpd.client import Client

WAIT = 5.0      # never reached when things work; a hang is forever


@pytest.fixture
def no_automatic_gc() -> Iterator[None]:
    """Only the test's own gc.collect (in a thread it can give up on) may collect."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def finishes(call: Callable[[], object]) -> bool:
    """Whether `call` returns within WAIT seconds (run in a thread that may stay stuck)."""
    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(WAIT)
    return not thread.is_alive()


def test_close_with_a_socket_still_open_and_a_message_pending(dead_endpoint: str) -> None:
    """A socket left open in the context, with the default linger (forever) and a message
    that can never be delivered: term() alone would wait on it forever."""
    client = Client(dead_endpoint)
    client.submit(input_ids=[1, 2])                     # queued: nothing listens there
    stray = client._ctx.socket(zmq.DEALER)
    stray.connect(f"tcp://{dead_endpoint}")
    stray.send(b"never delivered")
    assert finishes(client.close), "close() hung"
    assert client._ctx.closed and stray.closed


def test_close_twice(dead_endpoint: str) -> None:
    client = Client(dead_endpoint)
    assert finishes(client.close) and finishes(client.close)
    with Client(dead_endpoint) as c:
        c.close()                                       # and __exit__ closes again
    assert c._ctx.closed


def test_an_unclosed_client_is_collected_without_hanging(dead_endpoint: str,
                                                         no_automatic_gc: None) -> None:
    """A Client in a reference cycle (as a failed test's traceback holds one), never
    closed. The collector may finalize its Context before its socket; Context.__del__
    then waits in term() for that socket forever."""
    client = Client(dead_endpoint)
    client.submit(input_ids=[1, 2])
    ctx = weakref.ref(client._ctx)      # not a reference: the context is garbage too
    client.cycle = client
    del client
    assert finishes(gc.collect), "garbage collection hung on the client's context"
    assert ctx() is None or ctx().closed
