"""What a scheduler (prefill or decode) gives the worker core, and what it may ask of it.

The core owns the socket, the loop, liveness, the pause state and the admin commands;
a scheduler owns its requests. The core calls the scheduler through this protocol
only; the scheduler reads the core (`core.paused`, `core.send`, ...) but never
rewires it.
"""
from __future__ import annotations

from enum import Enum
from typing import TYPE_CHECKING, Callable, Mapping, Protocol

from zpd.wire.admin import Continue
from zpd.wire.admin_fields import PauseMode
from zpd.wire.admin_reply import AdminResult
from zpd.wire.protocol import Message
from zpd.wire.status import INTERNAL, UNAVAILABLE

if TYPE_CHECKING:
    from zpd.worker.pages import PageBook

Handler = Callable[[bytes, Message], None]      # (sender identity, message)
Respond = Callable[[bool, AdminResult], None]   # an admin command's answer: ok, result


class Gate(Enum):
    """May the worker schedule? One state, derived in one place (`Gate.of`, which
    `WorkerCore.gate` asks) from the pause and the memory: PAUSED wins over RELEASED,
    since a paused worker runs no round at all, while a released one runs rounds
    that admit nothing."""
    OPEN = "open"                 # rounds run and admit requests
    RELEASED = "released"         # KV pool or weights released: rounds admit nothing
    PAUSED = "paused"             # an admin pause: no scheduling round

    @classmethod
    def of(cls, paused: PauseMode | None, released: bool) -> Gate:
        """The gate of a worker paused in mode `paused` (None: not paused) whose KV pool
        or weights are `released`."""
        if paused is not None:
            return cls.PAUSED
        return cls.RELEASED if released else cls.OPEN


def step_failure(what: str, error: Exception, lost: str | None = None) -> tuple[int, str]:
    """The status and message of the requests a failed model step ends: 500, the step
    and the error, short enough for a log line and a client's finish_reason; or 503
    and why when the worker itself is lost (`lost`: a tensor-parallel rank died or
    froze, WorkerCore.failure), since the request may well succeed elsewhere."""
    text = f"{what} failed: {lost}" if lost else f"{what} failed: {type(error).__name__}: {error}"
    return (UNAVAILABLE if lost else INTERNAL), (text if len(text) <= 300 else text[:297] + "...")


class Scheduler(Protocol):
    """A worker role's request state machine, driven by the core's loop."""

    handlers: Mapping[type[Message], Handler]   # the request and peer messages it takes
    pages: PageBook                             # the worker's KV pages (zpd/worker/pages.py)

    def has_work(self) -> bool:
        """Something to run now: the loop must not block waiting for messages."""

    def step(self) -> None:
        """One scheduling round (admit, run the model, hand off); only while not paused."""

    def busy(self) -> bool:
        """Requests are in flight (update_weights without a pause is refused)."""

    def on_pause(self, mode: PauseMode) -> None:
        """Stop scheduling; `abort` ends, `retract` drops the KV of, every request."""

    def quiescent(self) -> bool:
        """A pause may be answered: nothing the pause waits for is still in flight."""

    def on_resume(self, cmd: Continue) -> int | None:
        """Re-admit what the pause held; how many held requests it re-admitted (None:
        this scheduler holds none), for the continue answer."""

    def on_memory_released(self) -> None:
        """The KV pool's memory was given back (the scheduler lets go of what it kept
        beside it: a prefill's staging buffers)."""

    def on_memory_resumed(self) -> None:
        """The KV pool was allocated again at a new address."""

    def on_peer_silent(self, identity: bytes) -> None:
        """A peer that used to ping us (a router) stopped."""

    def on_peer_back(self, identity: bytes) -> None:
        """A peer found silent pings again (the same process: it was frozen or cut off)."""

    def on_weights_changed(self) -> None:
        """New weights are in: KV kept from the old ones (a prefix cache) must go."""

    def flush_cache(self) -> int:
        """Drop cached KV no request uses (the caller checked none runs); pages freed."""

    def status(self) -> dict:
        """Queues, peers and the prefix cache for `status` (the core adds kv_pages,
        from `pages`)."""

    def close(self) -> None:
        """Close what the scheduler opened itself (sockets to peers)."""
