"""The request records of the two schedulers: one small record and one phase enum per
role. A job's phase changes only in its scheduler's `move` (prefill.py, decode.py);
the managers they own (dests.py, retraction.py) call that `move` and never set it.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from typing import TYPE_CHECKING

from engines.request import Request
from zpd.wire.deadline import Deadline

if TYPE_CHECKING:
    from zpd.wire.protocol import KvDest
    from zpd.worker.pages import Prefix


class JobPhase(enum.Enum):
    """Where a prefill job is; `PrefillScheduler.move` is the one place it changes."""
    NEW = "new"                # just made from its first message
    STASHED = "stashed"        # kv_dest came before the request: waiting for it
    REJECTED = "rejected"      # refused at admission: waiting for kv_dest to tell its decode
    QUEUED = "queued"          # waiting for pages and a forward (in `pending`)
    COMPUTING = "computing"    # in the forward being run
    COMPUTED = "computed"      # KV computed: waiting for kv_dest
    WRITING = "writing"        # KV write in flight
    ENDED = "ended"            # forgotten; a write may still be in flight (`transfer_id`)


@dataclass(eq=False)
class PrefillJob:
    """One (room, epoch) on this prefill."""
    room: int
    epoch: int
    deadline: Deadline
    phase: JobPhase = JobPhase.NEW
    req: Request | None = None           # None until the request comes
    decode: bytes | None = None          # decode's identity on our socket
    dest: KvDest | None = None           # where the decode wants the KV (its kv_dest)
    paired: str | None = None            # once the request came: the only decode endpoint
                                         # whose kv_dest counts (see `KvDests.pair`)
    offers: dict = field(default_factory=dict)   # STASHED: sender -> kv_dest, checked at `pair`
    transfer_id: int | None = None
    failure: tuple[int, str] | None = None   # REJECTED: what to tell the decode
    notice: tuple[int, str] | None = None    # kv_failed to send once the write is over
    marks: dict = field(default_factory=dict)   # monotonic times: queued, forward, computed
    early_to: bytes | None = None        # a streaming client's router: send it the first token
    answer_to: bytes | None = None       # a scoring request's router (max_new_tokens 0, no
                                         # decode): the prefill sends it the final answer
    prefix_keys: Prefix | None = None    # its prompt's prefix-cache keys (PageBook.prefix)
    skip: int = 0                        # leading pages that came from the prefix cache
    caller: tuple = ()                   # whose turn it takes in the queue (zpd/worker/fair.py)


class DecodePhase(enum.Enum):
    """Where a decode job is; `DecodeScheduler.move` is the one place it changes."""
    NEW = "new"                      # just made from its generate
    WAITING = "waiting"              # no pages yet (in `waiting`)
    TRANSFERRING = "transferring"    # pages reserved, KV asked of a prefill, no kv_done yet
    RUNNING = "running"              # in the decode batch
    HELD = "held"                    # retracted: no KV, waiting for continue
    FINISHED = "finished"


@dataclass(eq=False)
class DecodeJob:
    """One request on this decode, across its epochs."""
    room: int
    epoch: int
    req: Request
    prefill: str
    client: bytes            # the router's identity on our socket
    stream: bool
    deadline: Deadline
    phase: DecodePhase = DecodePhase.NEW
    sent: int = 0            # output tokens already sent to the client
    asked: int = -1          # the epoch whose kv_dest went out: its pages may be written
    skip: int = 0            # leading prefix pages from the prefix cache (not transferred)
    prefix_keys: Prefix | None = None    # its prefix's prefix-cache keys (PageBook.prefix)
    cached_tokens: int | None = None     # prompt tokens its first prefill took from its cache
    owner: str = ""          # the router's client (Generate.owner), for a restarted router

    @property
    def write_may_land(self) -> bool:
        """A prefill may still write into this job's pages."""
        return self.phase is DecodePhase.TRANSFERRING and self.asked == self.epoch
