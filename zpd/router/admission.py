"""The router's waiting room: requests that may not run yet wait here, in a bounded
queue, and leave it in a fair order.

A request waits while the router is paused or a weight push is under way, while
`--max-concurrent-requests` requests are already routed to the workers, or while its
client has its whole share in flight (zpd/router/shares.py). It leaves the room when
it is routed, aborted by its client or an admin, when its client hangs up, or with
an error past a stated bound: 429 when the room is full (below), 503 when it has
waited `--queue-timeout` seconds. Time spent paused or under a weight push does not
count: the queue's clock stands still then (a long update from disk must not fail the
requests that wait for it), and every waiting request gets its whole timeout after
continue.

Fairness has three levels: between clients (one ZeroMQ connection each), then
between the users one client names (`Generate.user`: the HTTP front names each HTTP
caller), then between one user's calls (`Generate.call`: the front names each HTTP
request, so a batch of 1,024 does not make the same user's next call wait behind it).
At each level the next to be served is the one with the fewest requests routed now
(max-min fair: a light caller passes a flood at the next free slot), ties in
round-robin order; the request taken is that call's oldest that fits its client's
share, and one skipped (its share is full) keeps its place. A connection that invents
user or call names gains nothing: they only share its own turns and its own share.

The room's `--queue-size` slots are shared the same way (longest queue drop): one
client may fill them all while alone, but when they are full the request refused is
the newest of whoever holds the most (the client with most waiting, within it the
user, within that the call), which is the newcomer itself unless it holds less than
its fair share. So a flood can hold no more than an equal share once others wait,
and another caller is always admitted. Plain Python, no sockets and no clock of its
own, so its every transition is a unit test (tests/unit/test_admission.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Hashable, Iterator

from zpd.router.shares import ClientShares
from zpd.wire.protocol import Generate, TokenPart, Tokens

QUEUE_FULL, QUEUE_TIMEOUT = 429, 503
RETRY_AFTER_S = 5              # what a refused client is told to wait before trying again
MEMORY = 4096                  # clients, users and calls whose last service is remembered
LEVELS = ("connection", "user", "call")      # what a Waiting's path names, level by level
FLOOR = (0, -1)       # the lowest rank in the fair order: nothing routed, never served


@dataclass(eq=False)
class Waiting:
    """One request in the waiting room."""
    rid: str
    client: bytes
    user: str
    msg: Generate
    tokens: int                 # what it will charge its client's share (shares.request_tokens)
    since: float                # when it arrived (the queue's clock: Admission.clock)
    call: str = ""              # which of its user's calls (Generate.call)

    @property
    def path(self) -> tuple[bytes, str, str]:
        return self.client, self.user, self.call


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


class Heaviest:
    """How many requests wait under each key, with the key holding most found in O(1)
    (a flood may name thousands of users): keys in buckets by count, each bucket in
    the order its keys reached it, so of equals the last to grow is the heaviest."""

    def __init__(self) -> None:
        self.count: dict[Hashable, int] = {}
        self.buckets: dict[int, dict[Hashable, None]] = {}
        self.top = 0

    def add(self, key: Hashable) -> None:
        n = self.count.get(key, 0)
        self._move(key, n, n + 1)
        self.top = max(self.top, n + 1)

    def drop(self, key: Hashable) -> None:
        n = self.count[key]
        self._move(key, n, n - 1)
        while self.top and self.top not in self.buckets:
            self.top -= 1

    def heaviest(self) -> Hashable:
        return next(reversed(self.buckets[self.top]))

    def _move(self, key: Hashable, old: int, new: int) -> None:
        if old:
            bucket = self.buckets[old]
            del bucket[key]
            if not bucket:
                del self.buckets[old]
        if new:
            self.buckets.setdefault(new, {})[key] = None
            self.count[key] = new
        else:
            del self.count[key]


@dataclass(eq=False)
class Node:
    """One level of the waiting room: the clients, one client's users, one user's calls
    (children: key -> Node), or one call's rids in order of arrival (children: rid ->
    None); `sizes` counts the requests waiting under each child."""
    children: dict = field(default_factory=dict)
    sizes: Heaviest = field(default_factory=Heaviest)


class Admission:
    """Waiting requests by client, then by user, then by call, each call's oldest first."""

    def __init__(self, queue_size: int, queue_timeout: float) -> None:
        if queue_size < 0 or queue_timeout <= 0:
            raise ValueError("--queue-size must be at least 0 and --queue-timeout positive")
        self.queue_size, self.queue_timeout = queue_size, queue_timeout
        self.waiting: dict[str, Waiting] = {}     # rid -> entry, in order of arrival
        self.tree = Node()                # client -> user -> call -> rids (Node)
        self.recency = Recency()          # keys: paths of 1, 2 and 3 levels
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
        return set(self.tree.children)

    def owner(self, rid: str) -> bytes | None:
        entry = self.waiting.get(rid)
        return None if entry is None else entry.client

    def of_client(self, client: bytes) -> list[str]:
        users = self.tree.children.get(client)
        return [] if users is None else [rid for calls in users.children.values()
                                         for rids in calls.children.values()
                                         for rid in rids.children]

    # --- transitions ------------------------------------------------------------------

    def add(self, entry: Waiting) -> None:
        """Queue `entry` (the router then routes what it can, and calls `overflow`)."""
        self.waiting[entry.rid] = entry
        node = self.tree
        for key in entry.path:
            node.sizes.add(key)
            node = node.children.setdefault(key, Node())
        node.children[entry.rid] = None

    def overflow(self) -> tuple[Waiting, int, str] | None:
        """If more than --queue-size requests wait, take out the newest of whoever holds
        most (client, then user, then call): (it, 429, why). Called after each add and
        the routing that follows it, so at most one is over, and --queue-size 0 means
        routed at once or refused."""
        if len(self.waiting) <= self.queue_size:
            return None
        node, shares = self.tree, []
        for level in LEVELS:
            key = node.sizes.heaviest()
            shares.append((level, node.sizes.count[key], len(node.children)))
            node = node.children[key]
        entry = self.remove(next(reversed(node.children)))
        return entry, QUEUE_FULL, self._full_message(shares)

    def _full_message(self, shares: list[tuple[str, int, int]]) -> str:
        """Why the room refused: full, and, where others wait too, the share of the
        first level at which the refused request's caller holds more than the others."""
        why = (f"queue full: {self.queue_size} requests already wait for the workers "
               f"(--queue-size {self.queue_size})")
        level, held, among = next(((lv, n, k) for lv, n, k in shares if k > 1), shares[-1])
        if among > 1:
            why += (f"; this {level} holds {held} of them, the most of the {among} {level}s "
                    f"that wait (a fair share: {self.queue_size // among})")
        return why + "; retry later"

    def remove(self, rid: str) -> Waiting | None:
        """Take `rid` out of the room (None: it is not here)."""
        entry = self.waiting.pop(rid, None)
        if entry is None:
            return None
        _unlink(self.tree, entry.path, rid)
        return entry

    def next(self, shares: ClientShares) -> Waiting | None:
        """Take the next request to run: the oldest of the first call, of the first
        user, of the first client, that fits its client's share; first means fewest
        requests routed now (max-min fair), then least recently served, then first to
        arrive. One skipped (its share is full) keeps its place. None: nothing waiting
        fits now."""
        head = self._first(self.tree, (), shares)
        if head is None:
            return None
        self.remove(head.rid)
        for depth in range(1, len(LEVELS) + 1):
            self.recency.serve(head.path[:depth])
        return head

    def _first(self, node: Node, path: tuple, shares: ClientShares) -> Waiting | None:
        if len(path) == len(LEVELS):
            head = self.waiting[next(iter(node.children))]
            return head if shares.fits(head.client, head.tokens) else None
        if len(path) == 1 and shares.full(path[0]):
            return None                       # nothing of this client fits: skip its users
        recent = self.recency.of
        for key in _in_order(node.children, lambda k: (shares.routed(*path, k), recent((*path, k)))):
            head = self._first(node.children[key], (*path, key), shares)
            if head is not None:
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


def ended(rid: str, status: int, reason: str, msg: Generate) -> Tokens:
    """The answer to a request that ends before it was routed; a refusal of the queue
    (429, 503) says when to retry (`retry_after`, seconds, in its finish_reason)."""
    part = TokenPart.abort(rid, status, reason, {
        "prompt_tokens": len(msg.input_ids), "completion_tokens": 0, "retractions": 0,
        "cached_tokens": 0})
    if status in (429, 503):
        part = replace(part, finish=part.finish | {"retry_after": RETRY_AFTER_S})
    return Tokens.pack([part])


def _unlink(node: Node, path: tuple, rid: str) -> None:
    """Take `rid` out of the tree under `node`, and every level it leaves empty."""
    if not path:
        del node.children[rid]
        return
    key = path[0]
    node.sizes.drop(key)
    child = node.children[key]
    _unlink(child, path[1:], rid)
    if not child.children:
        del node.children[key]


def _in_order(keys: dict, rank: Callable) -> Iterator:
    """`keys` by `rank`, ties in their order: the first found in one pass, which stops
    at the first key of the lowest rank there can be (FLOOR: nothing routed, never
    served; in a flood of fresh user names, the first key), the rest sorted only if
    the first is skipped (it usually is not)."""
    first, best = None, None
    for key in keys:
        r = rank(key)
        if best is None or r < best:
            first, best = key, r
            if r <= FLOOR:
                break
    if best is None:
        return
    yield first
    yield from (k for k in sorted(keys, key=rank) if k != first)
