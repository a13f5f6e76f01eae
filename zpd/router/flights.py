"""What the router knows of each worker and of each request it routed, and of each
word it sent to many peers (workers, or routers following it) awaiting their replies."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Generic, Hashable, TypeVar

from zpd.wire.first_token import FirstToken
from zpd.wire.liveness import PeerClock
from zpd.wire.loop import Timer
from zpd.wire.net import Dealer


@dataclass(eq=False)
class Worker:
    """One prefill or decode worker as the router sees it: its link, load and liveness."""
    role: str
    endpoint: str
    dealer: Dealer
    clock: PeerClock
    load: int = 0            # requests routed here and not done with this worker's part
    alive: bool = True


@dataclass(eq=False)
class InFlight:
    """A routed request, until its final answer passes through."""
    rid: str
    client: bytes
    prefill: Worker
    decode: Worker | None                # None: a scoring request, answered by its prefill
    sent: int = 0                        # output tokens passed on to the client
    from_decode: int = 0                 # output tokens the decode has sent
    early: FirstToken | None = None    # the first token, straight from the prefill
    prefilled: bool = False      # the decode sent tokens: no longer in its prefill's load
    routed: bool = False         # it asked for its routed experts: one Rows may pass
    rows: bool = False           # that Rows passed


R = TypeVar("R")          # a reply: a worker's (WorkerReply), a follower's (dict)


@dataclass(eq=False)
class Fanout(Generic[R]):
    """One message sent to many peers, done once all reply or time runs out."""
    on_done: Callable[[list[R]], None]
    waiting: set[Hashable]               # who has not replied: endpoints, identities
    replies: list[R] = field(default_factory=list)
    timer: Timer | None = None
    # called with each reply as it comes, and who is still waiting then
    each: Callable[[R, set[Hashable]], None] | None = None
