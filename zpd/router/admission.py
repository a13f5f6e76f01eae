"""The router's waiting room: requests that may not run yet wait here, in a bounded
queue, and leave it in a fair order.

A request waits while the router is paused or a weight push is under way, while
`--max-concurrent-requests` requests are already routed to the workers, or while its
client has its whole share in flight (zpd/router/shares.py). It leaves the room when
it is routed, aborted by its client or an admin, when its client hangs up, or with
an error past a stated bound: 429 when `--queue-size` requests already wait, 503
when it has waited `--queue-timeout` seconds. Time spent paused or under a weight
push does not count: the queue's clock stands still then (a long update from disk
must not fail the requests that wait for it), and every waiting request gets its
whole timeout after continue.

Fairness has two levels. First between clients (one ZeroMQ connection each), then
between the users one client names (`Generate.user`: the HTTP front names each HTTP
caller). At each level the next to be served is the one with the fewest requests
routed now (max-min fair: a light user passes a flood at the next free slot), ties
in round-robin order; the request taken is that user's oldest that fits its
client's share, and a client or user skipped (its share is full) keeps its place.
A connection that invents user names gains nothing: its users only share its own
turns and its own share. Plain Python, no sockets and no clock of its own, so its
every transition is a unit test (tests/unit/test_admission.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

from zpd.router.shares import ClientShares
from zpd.wire.protocol import Generate

QUEUE_FULL, QUEUE_TIMEOUT = 429, 503
RETRY_AFTER_S = 5              # what a refused client is told to wait before trying again
MEMORY = 4096                  # clients and users whose last service is remembered

@dataclass(eq=False)
class Waiting:
    """One request in the waiting room."""
    rid: str
    client: bytes
    user: str
    msg: Generate
    tokens: int                 # what it will charge its client's share (shares.request_tokens)
    since: float                # when it arrived (the queue's clock: Admission.clock)


class Recency:
    """When each key (a client, or a client's user) was last served, as a count of
    services, for the most recent MEMORY keys; a key never served (or long ago)
    ranks first."""

    def __init__(self) -> None:
        self.served: dict = {}        # key -> stamp, least recently served first
        self.count = 0

    def of(self, key: object) -> int:
        return self.served.get(key, -1)

    def serve(self, key: object) -> None:
        self.served.pop(key, None)
        self.served[key] = self.count = self.count + 1
        if len(self.served) > MEMORY:
            del self.served[next(iter(self.served))]


class Admission:
    """Waiting requests by client, then by user, each user's oldest first."""

    def __init__(self, queue_size: int, queue_timeout: float) -> None:
        if queue_size < 0 or queue_timeout <= 0:
            raise ValueError("--queue-size must be at least 0 and --queue-timeout positive")
        self.queue_size, self.queue_timeout = queue_size, queue_timeout
        self.waiting: dict[str, Waiting] = {}     # rid -> entry, in order of arrival
        # client -> user -> rids, each level in order of arrival
        self.rids: dict[bytes, dict[str, dict[str, None]]] = {}
        self.recency = Recency()          # keys: clients, and (client, user) pairs
        self.stood = 0.0                  # seconds the queue's clock stood still, in all
        self.held_since: float | None = None   # standing still since (loop time)

    # --- the queue's clock: the loop's, less the time the router held everything -------

    def clock(self, now: float) -> float:
        held = now - self.held_since if self.held_since is not None else 0.0
        return now - self.stood - held

    def hold(self, held: bool, now: float) -> None:
        """The router is paused or pushing weights (`held`), or not: the clock stands
        still while held."""
        if held and self.held_since is None:
            self.held_since = now
        elif not held and self.held_since is not None:
            self.stood += now - self.held_since
            self.held_since = None

    # --- what the router's dict of queued requests was: len, in, iteration by rid ----

    def __len__(self) -> int:
        return len(self.waiting)

    def __contains__(self, rid: object) -> bool:
        return rid in self.waiting

    def __iter__(self) -> Iterator[str]:
        return iter(self.waiting)

    def clients(self) -> set[bytes]:
        return set(self.rids)

    def owner(self, rid: str) -> bytes | None:
        entry = self.waiting.get(rid)
        return None if entry is None else entry.client

    def of_client(self, client: bytes) -> list[str]:
        return [rid for users in self.rids.get(client, {}).values() for rid in users]

    # --- transitions ------------------------------------------------------------------

    def add(self, entry: Waiting) -> None:
        """Queue `entry` (the router then routes what it can, and calls `overflow`)."""
        self.waiting[entry.rid] = entry
        self.rids.setdefault(entry.client, {}).setdefault(entry.user, {})[entry.rid] = None

    def overflow(self, rid: str) -> tuple[int, str] | None:
        """If more than --queue-size requests wait and `rid`, just added, is one of them,
        take it out: (429, why). Checked after routing, so --queue-size 0 means routed
        at once or refused."""
        if len(self.waiting) <= self.queue_size or rid not in self.waiting:
            return None
        self.remove(rid)
        return QUEUE_FULL, (f"queue full: {len(self.waiting)} requests already wait for the "
                            f"workers (--queue-size {self.queue_size}); retry later")

    def remove(self, rid: str) -> Waiting | None:
        """Take `rid` out of the room (None: it is not here)."""
        entry = self.waiting.pop(rid, None)
        if entry is None:
            return None
        users = self.rids[entry.client]
        rids = users[entry.user]
        del rids[rid]
        if not rids:
            del users[entry.user]
        if not users:
            del self.rids[entry.client]
        return entry

    def next(self, shares: ClientShares) -> Waiting | None:
        """Take the next request to run: the oldest of the first user, of the first
        client, that fits its client's share; first means fewest requests routed now
        (max-min fair), then least recently served, then first to arrive. One skipped
        (its share is full) keeps its place. None: nothing waiting fits now."""
        recent = self.recency.of
        for client in _in_order(self.rids, lambda c: (shares.routed(c), recent(c))):
            users = self.rids[client]
            for user in _in_order(users, lambda u: (shares.routed(client, u), recent((client, u)))):
                head = self.waiting[next(iter(users[user]))]
                if shares.fits(client, head.tokens):
                    self.remove(head.rid)
                    self.recency.serve(client)
                    self.recency.serve((client, user))
                    return head
        return None

    def expired(self, now: float) -> list[Waiting]:
        """Take out every request that has waited longer than the queue timeout (`now`:
        the loop's clock)."""
        late, now = [], self.clock(now)
        for entry in self.waiting.values():           # oldest first: stop at the first in time
            if now - entry.since <= self.queue_timeout:
                break
            late.append(entry)
        for entry in late:
            self.remove(entry.rid)
        return late

    def timeout_message(self, entry: Waiting, now: float) -> str:
        return (f"queue timeout: waited {self.clock(now) - entry.since:.0f} s for the workers "
                f"(--queue-timeout {self.queue_timeout:g}); retry later")


def _in_order(keys: dict, rank: Callable) -> Iterator:
    """`keys` by `rank`, ties in their order: the first found in one pass, the rest
    sorted only if the first is skipped (it usually is not)."""
    if not keys:
        return
    first = min(keys, key=rank)
    yield first
    yield from (k for k in sorted(keys, key=rank) if k != first)
