"""What the router's optional parts plug into: the calls the core makes on the routers
that share its pool (zpd/router/ha/peers.py), on its adoption of a predecessor's
requests (zpd/router/ha/adoption.py), and what stands in for the followers when
none can follow (a router alone). The assembly (zpd/ops/router.py) plugs them in;
the core never imports them."""
from __future__ import annotations

from typing import Callable, Collection, Protocol

from zpd.router.flights import Worker
from zpd.wire.protocol import Admin, AdminReply, Adopted, Resume, Rows, TokenPart

Acks = Callable[[list[dict]], None]
# A follower that does not confirm a hold within this share of the command's timeout
# is reported in the answer and not waited for: a wedged router must not stall pauses.
HOLD_SHARE = 0.25


class Peers(Protocol):
    """The routers following this one: told its state, asked to run a command."""

    def tell(self, then: Acks, timeout: float, early: bool = False) -> None: ...

    def ask(self, command: str, args: dict, then: Acks, timeout: float) -> None: ...

    def expire(self, now: float) -> None: ...

    def inflight(self) -> int: ...

    def fields(self) -> list[dict]: ...

    def on_admin(self, identity: bytes, msg: Admin) -> bool: ...

    def on_reply(self, identity: bytes, msg: AdminReply) -> bool: ...


class Coordinator(Protocol):
    """The router this one follows: its pushes and released memory hold our
    requests, it answers most admin commands."""
    pushing: bool
    memory_released: bool

    def heartbeat(self) -> None: ...

    def passes(self, command: str, args: dict) -> bool: ...

    def pass_on(self, client: bytes, msg: Admin, timeout: float) -> None: ...

    def fields(self) -> dict: ...

    def close(self) -> None: ...


class Restart(Protocol):
    """The requests a restarted router took over from its predecessor."""
    unclaimed: Collection[str]          # adopted, their client not back yet

    def hold(self, part: TokenPart) -> bool: ...

    def hold_rows(self, msg: Rows) -> bool: ...

    def on_resume(self, client: bytes, msg: Resume) -> None: ...

    def on_adopted(self, worker: Worker, msg: Adopted) -> None: ...


class Alone:
    """No router follows this one: every word to the followers is confirmed at once."""

    def tell(self, then: Acks, timeout: float, early: bool = False) -> None:
        then([])

    def ask(self, command: str, args: dict, then: Acks, timeout: float) -> None:
        then([])

    def expire(self, now: float) -> None:
        """Nobody to forget."""

    def inflight(self) -> int:
        return 0

    def fields(self) -> list[dict]:
        return []

    def on_admin(self, identity: bytes, msg: Admin) -> bool:
        return False

    def on_reply(self, identity: bytes, msg: AdminReply) -> bool:
        return False
