"""How a ``Loop`` learns which of its sockets and fds are ready.

``EpollWaiter`` (the default on Linux) makes a wake-up cost O(ready sources): one
epoll set holds every socket's ZMQ_FD, the raw fds and the loop's wake-up pipe, and
only the sockets whose fd fired have their ZMQ_EVENTS read. ``PollWaiter`` is the
old way, ``zmq.Poller`` over every source (it reads every socket's ZMQ_EVENTS each
time): kept where ``select.epoll`` is missing and as the benchmark's baseline.

ZMQ_FD is not a socket's readability. It is the socket's mailbox signal: readable
when the socket has commands to process (a peer's "a message is ready"), and reset
by whatever processes them: reading ZMQ_EVENTS, but also any send or receive on the
socket (libzmq's zmq_getsockopt(3): "after calling zmq_send the socket may become
readable (and vice versa) without triggering a read event on the file
descriptor"). So, besides the sockets whose fd fired, the waiter reads ZMQ_EVENTS
of every socket in ``maybe`` before it sleeps: those a drain left messages in
(``max_batch``), those just added, and those sent on or received from outside
their drain. The ``zpd.wire.net`` wrappers report each send and receive into
``maybe`` themselves (their ``touched`` field); a bare ``zmq.Socket`` cannot, so
its ZMQ_EVENTS are read at every wake-up, as before; ``Loop.touch`` reports use by
anything else (another thread's poll of a lent socket).

A sweep bounds what those rules miss: at most every ``sweep_s`` (at a wake-up) every
socket is drained (ZMQ_EVENTS read), O(sockets) once per 50 ms instead of at every
wake-up. Under heavy load (a simulated pool of 80 workers in one process, the
machine's load at 10+) a socket was occasionally found readable with no edge on its
fd and stayed so until the next sweep; without the sweep such a worker could go
unheard past the peer timeout. ``rescued`` counts them (and the first of each power
of two is logged).
"""

from __future__ import annotations

import logging
import math
import select
import time
from typing import Any, Iterable

import zmq

log = logging.getLogger("zpd.wire.readiness")

Ready = tuple[Iterable[zmq.Socket], list[int]]   # sockets to drain, fds readable
SWEEP_S = 0.05      # seconds between reads of every socket's ZMQ_EVENTS (at a wake-up)


# Plain ints: `events & zmq.POLLIN` builds a PollEvent flag each time (1.3 us here),
# at every message of every socket.
EVENTS, POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)


def readable(sock: zmq.Socket) -> bool:
    """The socket has a message to receive now (False once it is closed)."""
    try:
        return bool(sock.getsockopt(EVENTS) & POLLIN)
    except zmq.ZMQError:       # closed under us: nothing to read
        return False


class EpollWaiter:
    """Waits in one epoll set; reads ZMQ_EVENTS only of the sockets that may be ready."""

    def __init__(self, sweep_s: float = SWEEP_S) -> None:
        self._ep = select.epoll()
        self.sweep_s = sweep_s
        self._sweep_at = time.monotonic() + sweep_s
        self.rescued = 0      # sockets a sweep found readable with no edge on their fd
        self._socket_at: dict[int, zmq.Socket] = {}   # ZMQ_FD -> its socket
        self._fd_of: dict[zmq.Socket, int] = {}
        self._owner: dict[zmq.Socket, Any] = {}       # the wrapper told of `maybe`
        self._always: set[int] = set()    # fds epoll refuses (regular files): always readable
        self._unhooked: set[zmq.Socket] = set()       # bare sockets: read at every wake-up
        # ZMQ_EVENTS to read before sleeping; the wrappers add to it from their
        # send/recv (a set's add is atomic: a lent socket's helper thread may add).
        self.maybe: set[zmq.Socket] = set()

    def add_socket(self, sock: zmq.Socket, source: Any) -> None:
        fd = sock.getsockopt(zmq.FD)
        stale = self._socket_at.get(fd)
        if stale is not None and stale is not sock:   # closed unremoved; its fd reused
            self.remove_socket(stale)
        self._socket_at[fd], self._fd_of[sock] = sock, fd
        self._register(fd)
        if hasattr(source, "touched"):
            source.touched, self._owner[sock] = self.maybe, source
        else:
            self._unhooked.add(sock)
        self.maybe.add(sock)            # messages queued before we watched raise no edge

    def remove_socket(self, sock: zmq.Socket) -> None:
        fd = self._fd_of.pop(sock, None)
        if fd is None:
            return
        del self._socket_at[fd]
        owner = self._owner.pop(sock, None)
        if owner is not None and owner.touched is self.maybe:
            owner.touched = None
        self._unhooked.discard(sock)
        self.maybe.discard(sock)
        self._unregister(fd)

    def add_fd(self, fd: int) -> None:
        try:
            self._register(fd)
        except PermissionError:         # a regular file: poll(2) calls it always readable
            self._always.add(fd)

    def remove_fd(self, fd: int) -> None:
        if fd in self._always:
            self._always.discard(fd)
        else:
            self._unregister(fd)

    def wait(self, timeout: float) -> Ready:
        """Sleep up to `timeout` seconds (not at all if a socket in `maybe` is ready);
        the sockets to drain (each is checked before each message) and the fds ready."""
        maybe = self.maybe
        candidates = set(maybe) | self._unhooked if self._unhooked else set(maybe)
        maybe.difference_update(candidates)
        if timeout > 0 and candidates:
            candidates = {s for s in candidates if readable(s)}
            if candidates:
                timeout = 0.0
        if self._always:
            timeout = 0.0
        fds: list[int] = []
        socket_at = self._socket_at
        for fd, _ in self._ep.poll(timeout if timeout > 0 else 0):
            sock = socket_at.get(fd)
            if sock is None:
                fds.append(fd)
            else:
                candidates.add(sock)
        fds.extend(self._always)
        if time.monotonic() >= self._sweep_at:
            self._sweep(candidates)
        return candidates, fds

    def _sweep(self, candidates: set[zmq.Socket]) -> None:
        self._sweep_at = time.monotonic() + self.sweep_s
        for sock, fd in self._fd_of.items():
            if sock in candidates or select.select([fd], [], [], 0)[0]:
                continue            # to be drained, or its fd fires at the next wait
            if readable(sock):
                candidates.add(sock)
                self.rescued += 1
                if self.rescued & (self.rescued - 1) == 0:
                    log.warning("a socket was readable with no ZMQ_FD edge; drained by the "
                                "sweep (%d so far)", self.rescued)

    def settled(self, sock: zmq.Socket) -> None:
        """Its ZMQ_EVENTS were read after its last send/recv and said nothing to read:
        its fd will fire for the next message."""
        self.maybe.discard(sock)

    def leftover(self, sock: zmq.Socket) -> None:
        """A drain stopped at max_batch: it may hold more, and its fd will not say."""
        self.maybe.add(sock)

    def close(self) -> None:
        for owner in self._owner.values():
            if owner.touched is self.maybe:
                owner.touched = None
        self._ep.close()

    def _register(self, fd: int) -> None:
        try:
            self._ep.register(fd, select.EPOLLIN)
        except FileExistsError:
            self._ep.modify(fd, select.EPOLLIN)

    def _unregister(self, fd: int) -> None:
        try:
            self._ep.unregister(fd)
        except (OSError, ValueError):   # closed already: the kernel dropped it
            pass


class PollWaiter:
    """``zmq.Poller`` over every source: each wake-up reads every socket's ZMQ_EVENTS."""

    def __init__(self) -> None:
        self._poller = zmq.Poller()
        self._sockets: set[zmq.Socket] = set()
        self._fds: set[int] = set()

    def add_socket(self, sock: zmq.Socket, source: Any) -> None:
        self._sockets.add(sock)
        self._poller.register(sock, zmq.POLLIN)

    def remove_socket(self, sock: zmq.Socket) -> None:
        if sock in self._sockets:
            self._sockets.discard(sock)
            self._poller.unregister(sock)

    def add_fd(self, fd: int) -> None:
        self._fds.add(fd)
        self._poller.register(fd, zmq.POLLIN)

    def remove_fd(self, fd: int) -> None:
        if fd in self._fds:
            self._fds.discard(fd)
            self._poller.unregister(fd)

    def wait(self, timeout: float) -> Ready:
        socks: list[zmq.Socket] = []
        fds: list[int] = []
        for source, _ in self._poller.poll(math.ceil(timeout * 1000)):
            (socks if isinstance(source, zmq.Socket) else fds).append(source)
        return socks, fds

    def settled(self, sock: zmq.Socket) -> None:
        pass                            # level-triggered: nothing to remember

    def leftover(self, sock: zmq.Socket) -> None:
        pass

    def close(self) -> None:
        pass


WAITERS = {"epoll": EpollWaiter, "poll": PollWaiter}


def make_waiter(kind: str | None) -> EpollWaiter | PollWaiter:
    """`kind` "epoll" or "poll"; None: epoll where the platform has it."""
    if kind is None:
        kind = "epoll" if hasattr(select, "epoll") else "poll"
    if kind not in WAITERS:
        raise ValueError(f"unknown waiter {kind!r}: want one of {sorted(WAITERS)}")
    return WAITERS[kind]()
