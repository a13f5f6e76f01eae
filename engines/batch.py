"""Continuous batching of decode steps: requests join and leave between steps."""
from __future__ import annotations

from engines.compute import Compute
from engines.request import Request


class DecodeBatch:
    """The running set of one decode process (also used by `zpd run`)."""

    def __init__(self, compute: Compute, max_batch: int) -> None:
        self.compute, self.max_batch = compute, max_batch
        self.running: dict[str, Request] = {}

    def __len__(self) -> int:
        return len(self.running)

    @property
    def has_room(self) -> bool:
        return len(self.running) < self.max_batch

    def add(self, req: Request) -> None:
        self.running[req.rid] = req

    def remove(self, rid: str) -> Request | None:
        return self.running.pop(rid, None)

    def step(self) -> list[Request]:
        """One token for every running request; returns those that got one."""
        reqs = list(self.running.values())
        if not reqs:
            return []
        self.compute.decode(reqs)
        for r in reqs:
            if r.finished:
                self.running.pop(r.rid)
        return reqs
