"""The decodes a prefill writes into, as each described itself at hello, and the checks
that keep a peer's words from steering our writes anywhere else.

A prefill writes where a decode's `kv_dest` says, so everything in it is checked
against what that decode announced in its hello (endpoint, session, its ranks' pools
and their size) and against what the router assigned (the room's decode endpoint):

- a hello whose pools are impossible (no pages, a null address, a range past 2**64,
  kv heads outside the model's, a head in no pool, ranges that overlap without being
  equal, our own session) is refused, and so is every kv_dest from that peer;
- a kv_dest counts only from the peer whose hello named the endpoint the router gave
  the room (`Generate.decode`), see `KvDests.pair` (zpd/worker/dests.py);
- its page ids must lie in that peer's pool, be distinct and, with the pages it says
  it holds cached, be exactly as many as the prefix needs.

Limit: without CURVE anyone may connect and say hello with any endpoint, so the
endpoint check stops only an impostor that does not also claim the right decode's
endpoint (and knows the room). With `--curve-keys` only cluster keys may send hello
and kv_dest at all (zpd.wire.security), and the checks here also hold a confused or
compromised cluster member to its own pool and rooms.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Callable, Iterator, Sequence

from engines.kv.layout import KVLayout
from engines.tp.transfer import RankPool
from zpd.wire.net import format_endpoint, parse_endpoint
from zpd.wire.protocol import Hello, KvDest, KvFailed, Message

log = logging.getLogger("zpd.worker.peers")

MAX_PAGES = 2**31 - 1          # page ids travel as int32
ADDRESS_LIMIT = 2**64          # every byte of a pool must have a 64-bit address
MAX_POOLS = 1024               # ranks of one decode: more than any tensor-parallel group
FORBIDDEN = 403                # a kv_dest for a room given to another decode (as for CURVE rights)


@dataclass(frozen=True)
class DecodePeer:
    endpoint: str              # where it listens, as `endpoint_key` spells it
    session: str               # its transport session: where our writes go
    pools: tuple[RankPool, ...]    # its ranks' KV pools, in rank order
    num_pages: int             # pages of each pool (its ranks share page ids)


def endpoint_key(endpoint: str) -> str:
    """One spelling per endpoint ("tcp://" dropped, host lower-cased, IPv6 bracketed),
    so the router's name for a decode and the decode's own compare equal."""
    try:
        host, port = parse_endpoint(endpoint)
    except ValueError:
        return endpoint                          # e.g. inproc:// (tests)
    return format_endpoint(host.lower(), port)


def model_layout(layout: KVLayout, pools: Sequence[RankPool]) -> KVLayout:
    """The whole model's KV layout (what a hello states and peers compare), from one
    rank's `layout` and every rank's pool: their kv heads together."""
    return replace(layout, num_kv_heads=max(p.heads.stop for p in pools))


def pool_problem(msg: Hello, layout: KVLayout, own_session: str) -> str:
    """Why the pools a hello announces cannot be written into, or "". `layout`: the
    whole model's (ours, which a compatible decode shares)."""
    if not msg.decode:
        return "the hello names no decode endpoint"
    if not msg.session_id or msg.session_id == own_session:
        return f"transport session {msg.session_id!r} is not a peer's"
    if not 0 < msg.num_pages <= MAX_PAGES:
        return f"a pool of {msg.num_pages} pages (want 1 to {MAX_PAGES})"
    if not 0 < len(msg.pools) <= MAX_POOLS:
        return f"{len(msg.pools)} pools announced (want 1 to {MAX_POOLS})"
    per_head = msg.num_pages * layout.page_bytes // layout.num_kv_heads   # bytes of a pool, per head
    for i, pool in enumerate(msg.pools):
        problem = _rank_pool_problem(i, pool, layout.num_kv_heads, per_head)
        if problem:
            return problem
    return _heads_problem({(p[0], p[1]) for p in msg.pools}, layout.num_kv_heads)


def _rank_pool_problem(rank: int, pool: list[int], kv_heads: int, per_head: int) -> str:
    """Why one announced [head_start, head_stop, base_addr] is impossible, or ""."""
    if len(pool) != 3:
        return f"pool {rank} has {len(pool)} numbers, not [head_start, head_stop, base_addr]"
    start, stop, base = pool
    if not 0 <= start < stop <= kv_heads:
        return f"pool {rank} holds kv heads [{start}, {stop}) of the model's {kv_heads}"
    nbytes = per_head * (stop - start)
    if base <= 0 or base + nbytes >= ADDRESS_LIMIT:
        return f"a pool of {nbytes} bytes at {base:#x} is not a valid address range"
    return ""


def _heads_problem(ranges: set[tuple[int, int]], kv_heads: int) -> str:
    """The distinct head ranges must split the model's kv heads: every head in one of
    them (replicas repeat a range whole), which also bounds our staging
    (engines/tp/transfer.py)."""
    covered = 0
    for start, stop in sorted(ranges):
        if start < covered:
            return f"kv head ranges overlap at [{start}, {covered})"
        if start > covered:
            return f"kv heads [{covered}, {start}) are in no pool"
        covered = stop
    return "" if covered == kv_heads else f"kv heads [{covered}, {kv_heads}) are in no pool"


def rank_pools(msg: Hello) -> tuple[RankPool, ...]:
    """The pools of a hello that passed `pool_problem`."""
    return tuple(RankPool(range(start, stop), base) for start, stop, base in msg.pools)


def pages_problem(pages: list[int], cached: int, need: int, num_pages: int) -> str:
    """Why `pages` cannot hold a prefix of `need` pages whose first `cached` the decode
    holds already (its prefix cache), in a pool of `num_pages`, or "". At least the
    last page is written."""
    if cached + len(pages) != need:
        return f"decode gave {len(pages)} pages and {cached} cached for {need}"
    if not pages:
        return "decode skipped every page of the prefix"
    outside = next((p for p in pages if not 0 <= p < num_pages), None)
    if outside is not None:
        return f"page id {outside} is outside the decode's pool of {num_pages} pages"
    if len(set(pages)) != len(pages):
        return "decode gave the same page twice"
    return ""


class DecodePeers:
    """The decodes that said hello, by their identity on our socket, and who of them
    may say where a room's KV goes. `send` answers a refused kv_dest."""

    def __init__(self, layout: KVLayout, own_session: str,
                 send: Callable[[bytes, Message], None]) -> None:
        """`layout`: the whole model's KV layout (`model_layout`)."""
        self.layout, self.own_session, self.send = layout, own_session, send
        self._peers: dict[bytes, DecodePeer] = {}
        self.refused = 0                          # kv_dests refused so far

    def hello(self, identity: bytes, msg: Hello) -> str:
        """Record the peer's pool; "" or why it was refused (a refused peer is
        forgotten, so none of its kv_dests count)."""
        problem = pool_problem(msg, self.layout, self.own_session)
        if problem:
            self._peers.pop(identity, None)
        else:
            self._peers[identity] = DecodePeer(endpoint_key(msg.decode), msg.session_id,
                                               rank_pools(msg), msg.num_pages)
        return problem

    def forget(self, identity: bytes) -> None:
        self._peers.pop(identity, None)

    def may_send(self, identity: bytes, paired: str | None, sender: bytes | None) -> bool:
        """Whether `identity` is a room's decode: its hello named `paired`, the endpoint
        the router gave the room, and it is the `sender` of the recompute, if any."""
        said = self.endpoint(identity)
        return bool(said) and said == paired and sender in (None, identity)

    def settle(self, room: int, epoch: int, offers: dict[bytes, KvDest], paired: str,
               sender: bytes | None) -> tuple[bytes, KvDest] | None:
        """Of the kv_dests that came before the room's request, the room's decode's
        (sender, kv_dest); every other one is refused."""
        chosen = None
        for identity, dest in offers.items():
            if chosen is None and self.may_send(identity, paired, sender):
                chosen = (identity, dest)
            else:
                self.refuse(identity, room, epoch, paired)
        return chosen

    def refuse(self, identity: bytes, room: int, epoch: int, paired: str | None) -> None:
        """A kv_dest from a decode the room was not given to: tell it, touch nothing."""
        said = self.endpoint(identity)
        self.refused += 1
        if self.refused & (self.refused - 1) == 0:    # powers of two: a flood stays a few lines
            log.error("room=%d epoch=%d kv_dest from %r (decode %s) refused: the room's decode "
                      "is %s; if both are one process, give the router the address that decode "
                      "binds (%d refused so far)", room, epoch, identity[:64], said, paired,
                      self.refused)
        self.send(identity, KvFailed(room, epoch, FORBIDDEN, f"room {room} was not given to "
                                                             f"decode {said}"))

    def get(self, identity: bytes | None) -> DecodePeer | None:
        return None if identity is None else self._peers.get(identity)

    def endpoint(self, identity: bytes) -> str:
        """The endpoint the peer announced ("" for one that said no hello)."""
        peer = self._peers.get(identity)
        return "" if peer is None else peer.endpoint

    def dest_problem(self, identity: bytes | None, dest: KvDest, need: int) -> str:
        """Why the peer's `dest` is not a place for `need` pages of KV, or ""."""
        peer = self.get(identity)
        if peer is None:
            return "the decode's hello was refused or never came"
        return pages_problem(dest.page_ids, dest.cached_pages, need, peer.num_pages)

    def __contains__(self, identity: object) -> bool:
        return identity in self._peers

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._peers)

    def __len__(self) -> int:
        return len(self._peers)
