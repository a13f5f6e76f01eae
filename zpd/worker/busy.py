"""Answering pings while the scheduler thread is inside a long call.

A worker's scheduler thread owns its ROUTER socket and reads it between forwards.
A forward (or a weight load) longer than the peers' --peer-timeout would get a
healthy, busy worker declared dead and its requests failed. `BusyResponder` lends
the socket to a helper thread during such a call: once the call has lasted
`after_s`, the helper reads the socket, answers each message `answer` accepts (a
ping) at once, and keeps every other message, in arrival order, for the scheduler
thread, which handles them after the call. Calls shorter than `after_s` never
wake the helper's socket side, so a decode step pays two Event operations.

A ZeroMQ socket may be used from another thread if the two never overlap and a
full memory barrier separates them; `_lock` and the `_released` event are that
barrier: the scheduler touches the socket only before `busy()` starts or after it
has seen the helper give the socket back.
"""
from __future__ import annotations

import logging
import os
import threading
from collections import deque
from contextlib import contextmanager
from typing import Callable, Iterator

import zmq

from zpd.wire.net import Router
from zpd.wire.protocol import Message

log = logging.getLogger("zpd.worker.busy")

Answer = Callable[[bytes, Message], bool]   # True: handled on the helper thread


class BusyResponder:
    def __init__(self, router: Router, answer: Answer, after_s: float) -> None:
        if after_s <= 0:
            raise ValueError(f"after_s must be positive, got {after_s}")
        self.router, self.answer, self.after_s = router, answer, after_s
        self.backlog: deque[tuple[bytes, Message]] = deque()   # for the scheduler, in order
        self.served_calls = 0            # calls during which the helper held the socket
        self._lock = threading.Lock()
        self._call = 0                   # generation of the current or last call
        self._in_call = False
        self._serving = False
        self._closed = False
        self._started = threading.Event()    # set while a call runs
        self._ended = threading.Event()      # set while no call runs
        self._ended.set()
        self._released = threading.Event()  # the helper does not hold the socket
        self._released.set()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._thread = threading.Thread(target=self._run, name="busy-responder", daemon=True)
        self._thread.start()

    @contextmanager
    def busy(self) -> Iterator[None]:
        """Wrap a long call made on the scheduler thread; it must not use the socket."""
        with self._lock:
            self._call += 1
            self._in_call = True
            self._ended.clear()
            self._started.set()
        try:
            yield
        finally:
            with self._lock:
                self._in_call = False
                serving = self._serving
                self._started.clear()
                self._ended.set()
            if serving:
                os.write(self._wake_w, b"\0")
                self._released.wait()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._started.set()
        os.write(self._wake_w, b"\0")
        self._thread.join(timeout=5.0)
        os.close(self._wake_r)
        os.close(self._wake_w)

    # --- helper thread ------------------------------------------------------

    def _run(self) -> None:
        while True:
            self._started.wait()
            with self._lock:
                if self._closed:
                    return
                call = self._call
            if self._ended.wait(self.after_s):
                continue                     # a short call: it never needed us
            with self._lock:
                if self._closed:
                    return
                if not self._in_call or self._call != call:
                    continue
                self._serving = True
                self._released.clear()
            try:
                self.served_calls += 1
                self._serve()
            except Exception:                # noqa: BLE001 - the socket must come back
                log.exception("answering messages during a long call failed")
            finally:
                with self._lock:
                    self._serving = False
                self._released.set()

    def _serve(self) -> None:
        sock = self.router.socket
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        while True:
            events = dict(poller.poll(1000))
            if self._wake_r in events:
                try:
                    while os.read(self._wake_r, 64):
                        pass
                except BlockingIOError:
                    pass
                return
            while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                got = self.router.recv()
                if got is not None and not self.answer(*got):
                    self.backlog.append(got)
