"""A thread-safe list of completions with a wakeup file descriptor.

The scheduler thread sleeps in a zmq.Poller; helper threads must be able to
wake it. A non-blocking pipe is the portable way to turn "a completion is
waiting" into a readable fd that zmq.Poller (or select/epoll) understands.
"""

from __future__ import annotations

import os
import threading
import weakref

from .base import Completion


class CompletionQueue:
    """Completions produced by any thread, drained by the scheduler thread.

    The pipe holds at most one byte: it is written when the queue goes from
    empty to non-empty and emptied by `drain`, so it can never fill up and
    readiness matches "something is pending" exactly.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: list[Completion] = []
        self._signalled = False
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._read_fd, False)
        os.set_blocking(self._write_fd, False)
        # The fds outlive close() on purpose: the scheduler drains the last
        # failures after closing the backend, so they go with the object.
        self._finalizer = weakref.finalize(self, _close_fds, self._read_fd, self._write_fd)

    def fileno(self) -> int:
        return self._read_fd

    def put(self, completion: Completion) -> None:
        with self._lock:
            self._items.append(completion)
            self._signal()

    def nudge(self) -> None:
        """Make the fd readable without a completion (a backend that completes
        only when polled uses it to keep the scheduler polling)."""
        with self._lock:
            self._signal()

    def drain(self) -> list[Completion]:
        with self._lock:
            items, self._items = self._items, []
            if self._signalled:
                self._signalled = False
                _read_all(self._read_fd)
            return items

    def _signal(self) -> None:
        if not self._signalled:
            self._signalled = True
            os.write(self._write_fd, b"\x01")

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)


def _read_all(fd: int) -> None:
    try:
        while os.read(fd, 64):
            pass
    except BlockingIOError:
        pass


def _close_fds(*fds: int) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
