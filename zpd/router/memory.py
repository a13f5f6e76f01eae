"""What memory the workers have released (SGLang's /release_memory_occupation), as
the router last heard from them.

While any worker's KV pool or weights are released, new requests wait in the
router's queue as in a pause, not sent to a worker that cannot serve them (a decode
would wait for KV pages until its deadline, then fail 504). They run after
resume_memory. Unlike a pause the queue's clock runs: memory is released between
rollouts, not for an operator's step, so a request still waiting after
--queue-timeout ends 503 "memory released", which says what to call."""
from __future__ import annotations

from zpd.wire.admin_fields import KV_CACHE, WEIGHTS
from zpd.wire.admin_reply import MemoryState, WorkerReply, WorkerStatus

RELEASED = "released"


class ReleasedMemory:
    """endpoint -> what of it is released ("kv_cache", "weights"), from the replies to
    release_memory, resume_memory and status (so a restarted router learns it too). A
    worker that did not answer keeps what it had: a resume that failed leaves its
    memory released, and says so."""

    def __init__(self) -> None:
        self.workers: dict[str, tuple[str, ...]] = {}

    def __bool__(self) -> bool:
        return bool(self.workers)

    def note(self, replies: list[WorkerReply]) -> bool:
        """Take what the replies say; whether anything changed."""
        before = dict(self.workers)
        for r in replies:
            if not (r.ok and isinstance(r.result, (MemoryState, WorkerStatus))):
                continue
            what = tuple(tag for tag, state in ((KV_CACHE, r.result.memory),
                                                 (WEIGHTS, r.result.weights_memory))
                         if state == RELEASED)
            if what:
                self.workers[r.endpoint] = what
            else:
                self.workers.pop(r.endpoint, None)
        return self.workers != before

    def fields(self) -> list[dict]:
        return [{"endpoint": ep, "released": list(what)} for ep, what in self.workers.items()]


def timeout_message(waited: float, limit: float) -> str:
    """Why a request held for released memory ended (503)."""
    return (f"memory released: waited {waited:.0f} s (--queue-timeout {limit:g}) for "
            "/resume_memory_occupation; resume the memory, then retry")
