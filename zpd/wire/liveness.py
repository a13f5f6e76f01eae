"""Is a peer dead, or were we just not listening?

Every peer pair pings; a peer that stays silent past the timeout is dead. Silence
alone is not proof: if our own loop stalled (a long forward pass, a SIGSTOP, the
machine swapping), no ping went out, so no pong came back. A peer is therefore
dead only when it is silent for `timeout` *and* a ping of ours has been waiting
for an answer at least half that long, which a stall of ours cannot fake: the
first tick after a stall sends a fresh ping and gives the peer time to answer it.
"""
from __future__ import annotations


class PeerClock:
    """When one peer was last heard from and since when a ping of ours is unanswered."""

    __slots__ = ("last_seen", "pending_since")

    def __init__(self, now: float) -> None:
        self.last_seen = now
        self.pending_since: float | None = None

    def heard(self, now: float) -> None:
        """Any message from the peer: it is alive and has answered every earlier ping."""
        self.last_seen = now
        self.pending_since = None

    def pinged(self, now: float) -> None:
        if self.pending_since is None:
            self.pending_since = now

    def silent(self, now: float, timeout: float) -> bool:
        waiting = self.pending_since is not None and now - self.pending_since >= timeout / 2
        return waiting and now - self.last_seen > timeout

    def silence(self, now: float) -> float:
        return now - self.last_seen
