"""The scheduler thread's poller loop: sockets, raw fds, a deadline heap.

One ``Loop`` per scheduler thread. Each ``run_once`` sleeps (in epoll, over every
socket's ZMQ_FD: zpd/wire/readiness.py) until a socket or fd is ready or the
earliest deadline is due, dispatches the ready sources, then fires every due timer
in deadline order. A wake-up costs O(ready sources), not O(sockets). The heap makes
the per-iteration cost independent of how many deadlines are pending: peeking
is O(1), scheduling and cancelling O(log n) (cancel is lazy; the heap is
compacted when cancelled entries dominate it).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import os
import threading
import time
from collections import deque
from typing import Any, Callable, Optional, Protocol, Union

import zmq

from zpd.wire.readiness import make_waiter, readable

log = logging.getLogger("zpd.wire.loop")

Clock = Callable[[], float]


class HasSocket(Protocol):
    """Anything wrapping a zmq socket (``zpd.wire.net.Router``/``Dealer``)."""

    socket: zmq.Socket


class Timer:
    """Handle for one scheduled call; ``cancel()`` is idempotent and a no-op
    once the call has run."""

    __slots__ = ("when", "fn", "args", "_loop")

    def __init__(self, when: float, fn: Callable[..., Any], args: tuple, loop: "Loop") -> None:
        self.when = when
        self.fn = fn
        self.args = args
        self._loop: Optional[Loop] = loop  # None once fired or cancelled

    @property
    def active(self) -> bool:
        """True while the call is still pending."""
        return self._loop is not None

    def cancel(self) -> None:
        """Stop the call from running; its heap entry is dropped lazily, but what the
        call would have reached is let go now (a scoring job's deadline held its
        prompt logprobs, ~5 MB a prompt, for the deadline's whole length)."""
        loop, self._loop = self._loop, None
        self.fn, self.args = None, ()
        if loop is not None:
            loop._note_cancelled()


class Periodic:
    """Handle for ``Loop.every``: a call repeated every ``interval`` seconds."""

    def __init__(self, loop: "Loop", interval: float, fn: Callable[..., Any], args: tuple) -> None:
        self._loop = loop
        self.interval = interval
        self._fn = fn
        self._args = args
        first = loop.time() + interval
        self._timer = loop.call_at(first, self._tick, first)

    def _tick(self, due: float) -> None:
        # Next due from the schedule, not from now, so the period does not
        # drift; after a stall skip missed beats instead of firing a burst.
        nxt = due + self.interval
        now = self._loop.time()
        if nxt <= now:
            nxt = now + self.interval
        self._timer = self._loop.call_at(nxt, self._tick, nxt)
        self._fn(*self._args)

    def cancel(self) -> None:
        """Stop future calls."""
        self._timer.cancel()


class Loop:
    """A poller loop owning sockets, fds and timers; not thread-safe except
    ``call_soon_threadsafe`` and ``stop``. ``clock`` is injectable so tests can
    drive timers deterministically (then call ``run_once(max_wait=0)``).
    ``waiter``: "epoll" (the default where the platform has it) or "poll" (zmq.Poller
    over every source each wake-up: the old way, for platforms without epoll and
    for comparison)."""

    def __init__(self, clock: Clock = time.monotonic, *, max_batch: int = 64,
                 max_poll: float = 1.0, compact_min: int = 256, busy_poll: float = 0.0,
                 waiter: Optional[str] = None) -> None:
        self.time = clock
        self.max_batch = max_batch  # messages drained per socket per iteration
        self.max_poll = max_poll  # longest single sleep, so stop_event is seen
        # Seconds after a message (or fd, or cross-thread call) during which the loop
        # polls without sleeping: the next hop of a request usually follows within
        # a millisecond, and waking a thread that slept costs more than that.
        self.busy_poll = busy_poll
        self._active_at = -math.inf
        self._compact_min = compact_min
        self._waiter = make_waiter(waiter)
        self._sockets: dict[zmq.Socket, Callable[[], None]] = {}
        self._fds: dict[int, Callable[[], None]] = {}
        self._heap: list[tuple[float, int, Timer]] = []
        self._seq = itertools.count()
        self._cancelled = 0  # cancelled entries still in the heap
        self._ready: deque[tuple[Callable[..., Any], tuple]] = deque()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._waiter.add_fd(self._wake_r)
        self._stopping = False
        self._firing = False
        self.max_late = 0.0  # seconds: the latest any timer fired after its time (status)

    # --- registration ----------------------------------------------------

    def add_socket(self, source: Union[zmq.Socket, HasSocket], on_readable: Callable[[], None]) -> None:
        """Call ``on_readable()`` once per pending message (up to max_batch
        per iteration); it must consume at most one, e.g. ``router.recv()``."""
        sock = source if isinstance(source, zmq.Socket) else source.socket
        self._sockets[sock] = on_readable
        self._waiter.add_socket(sock, source)

    def remove_socket(self, source: Union[zmq.Socket, HasSocket]) -> None:
        """Stop watching a socket (before closing it)."""
        sock = source if isinstance(source, zmq.Socket) else source.socket
        if self._sockets.pop(sock, None) is not None:
            self._waiter.remove_socket(sock)

    def touch(self, source: Union[zmq.Socket, HasSocket]) -> None:
        """A watched socket was used where the loop cannot see it (another thread
        polled or read it): its ZMQ_EVENTS are read before the loop next sleeps,
        since that use may have taken the edge its ZMQ_FD would have fired on. The
        zpd.wire.net wrappers' own sends and receives need no call."""
        sock = source if isinstance(source, zmq.Socket) else source.socket
        if sock in self._sockets:
            self._waiter.leftover(sock)

    def add_fd(self, fd: int, on_readable: Callable[[], None]) -> None:
        """Call ``on_readable()`` whenever ``fd`` is readable (level-triggered:
        it must consume what made the fd readable)."""
        if fd in self._fds:
            self._waiter.remove_fd(fd)
        self._fds[fd] = on_readable
        self._waiter.add_fd(fd)

    def remove_fd(self, fd: int) -> None:
        """Stop watching ``fd``."""
        if self._fds.pop(fd, None) is not None:
            self._waiter.remove_fd(fd)

    # --- timers ------------------------------------------------------------

    def call_at(self, when: float, fn: Callable[..., Any], *args: Any) -> Timer:
        """Run ``fn(*args)`` once ``self.time() >= when``."""
        timer = Timer(when, fn, args, self)
        heapq.heappush(self._heap, (when, next(self._seq), timer))
        return timer

    def call_later(self, delay: float, fn: Callable[..., Any], *args: Any) -> Timer:
        """Run ``fn(*args)`` after ``delay`` seconds."""
        return self.call_at(self.time() + delay, fn, *args)

    def every(self, interval: float, fn: Callable[..., Any], *args: Any) -> Periodic:
        """Run ``fn(*args)`` every ``interval`` seconds, first after one interval."""
        if interval <= 0:
            raise ValueError("interval must be positive")
        return Periodic(self, interval, fn, args)

    @property
    def pending_timers(self) -> int:
        """Timers scheduled and not yet fired or cancelled."""
        return len(self._heap) - self._cancelled

    @property
    def heap_size(self) -> int:
        """Heap entries including cancelled ones awaiting removal."""
        return len(self._heap)

    def _note_cancelled(self) -> None:
        self._cancelled += 1
        if not self._firing:
            self._maybe_compact()

    def _maybe_compact(self) -> None:
        # Rebuild once cancelled entries are the majority: O(n) work after
        # >= n/2 cancels keeps cancel amortized O(1) and memory O(live).
        if self._cancelled >= self._compact_min and 2 * self._cancelled > len(self._heap):
            self._heap[:] = [e for e in self._heap if e[2]._loop is not None]
            heapq.heapify(self._heap)
            self._cancelled = 0

    def _next_deadline(self) -> Optional[float]:
        heap = self._heap
        while heap and heap[0][2]._loop is None:
            heapq.heappop(heap)
            self._cancelled -= 1
        return heap[0][0] if heap else None

    # --- cross-thread --------------------------------------------------------

    def call_soon_threadsafe(self, fn: Callable[..., Any], *args: Any) -> None:
        """From any thread: run ``fn(*args)`` on the loop thread soon, waking
        a blocked poll."""
        self._ready.append((fn, args))
        try:
            os.write(self._wake_w, b"\0")
        except BlockingIOError:
            pass  # pipe full: the loop is already bound to wake up

    def stop(self) -> None:
        """From any thread: make ``run`` return after the current iteration."""
        self._stopping = True
        self.call_soon_threadsafe(lambda: None)

    # --- running ---------------------------------------------------------------

    def run_once(self, max_wait: Optional[float] = None) -> None:
        """One iteration: poll, dispatch ready sources, fire due timers."""
        timeout = self._poll_timeout(max_wait)
        if timeout and self.busy_poll and self.time() - self._active_at < self.busy_poll:
            timeout = 0.0
        socks, fds = self._waiter.wait(timeout)
        busy = False
        for fd in fds:
            busy = True
            if fd == self._wake_r:
                self._run_ready()
            else:
                self._call(self._fds.get(fd))
        for sock in socks:
            busy = self._drain(sock) or busy
        if busy and self.busy_poll:
            self._active_at = self.time()
        self._fire_due()

    def run(self, stop_event: Optional[threading.Event] = None) -> None:
        """Iterate until ``stop()`` or ``stop_event`` is set (an Event is only
        checked between iterations, so it is seen within ``max_poll``)."""
        # Reset on the way out, not in: a stop() that races ahead of run()
        # from another thread must still stop it.
        try:
            while not self._stopping and not (stop_event is not None and stop_event.is_set()):
                self.run_once()
        finally:
            self._stopping = False

    def close(self) -> None:
        """Release the wakeup pipe; sockets stay open (their owners close them)."""
        self._waiter.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _poll_timeout(self, max_wait: Optional[float]) -> float:
        cap = self.max_poll if max_wait is None else min(max_wait, self.max_poll)
        if self._ready:
            return 0.0
        deadline = self._next_deadline()
        if deadline is None:
            return max(cap, 0.0)
        return max(0.0, min(cap, deadline - self.time()))

    def _drain(self, sock: zmq.Socket) -> bool:
        """Up to max_batch messages; True if there was one."""
        handler = self._sockets.get(sock)
        # Bounded so one chatty peer cannot starve the others or the timers.
        for n in range(self.max_batch):
            if handler is None:
                return n > 0
            if not readable(sock):
                # Read after the handlers' last send/recv on it: its fd fires next time.
                self._waiter.settled(sock)
                return n > 0
            self._call(handler)
            handler = self._sockets.get(sock)  # the handler may unregister it
        if handler is not None:
            self._waiter.leftover(sock)        # more may wait: no edge will say so
        return True

    def _run_ready(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass
        # Only what was queued before now: a callback that re-posts itself
        # runs next iteration instead of spinning here.
        for _ in range(len(self._ready)):
            fn, args = self._ready.popleft()
            self._call(fn, *args)

    def _fire_due(self) -> None:
        now = self.time()
        heap = self._heap
        # Timers created while firing wait for the next iteration, so a
        # callback that reschedules itself at "now" cannot loop forever here.
        first_new = next(self._seq)
        deferred: list[tuple[float, int, Timer]] = []
        self._firing = True  # no compaction under our feet while popping
        try:
            while heap and heap[0][0] <= now:
                entry = heapq.heappop(heap)
                timer = entry[2]
                if timer._loop is None:
                    self._cancelled -= 1
                elif entry[1] > first_new:
                    deferred.append(entry)
                else:
                    timer._loop = None
                    self.max_late = max(self.max_late, now - entry[0])
                    self._call(timer.fn, *timer.args)
        finally:
            for entry in deferred:
                heapq.heappush(heap, entry)
            self._firing = False
        self._maybe_compact()

    def _call(self, fn: Optional[Callable[..., Any]], *args: Any) -> None:
        if fn is None:
            return
        try:
            fn(*args)
        except Exception:
            log.exception("loop callback %r failed", fn)
