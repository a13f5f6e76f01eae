"""Losing control messages on purpose, for fault tests.

A drop plan names outgoing message types and how many of the first ones of each
type to drop; a worker reads it from $ZPD_DROP_MESSAGES when it starts (zpd/env.py):

    "kv_done:1"            the first kv_done this worker sends is lost
    "kv_dest:2,kv_failed:1"

Every message a worker sends to a peer goes through `WorkerCore.send` or
`PrefillLink.send`, which ask `DropPlan.drops` first, so a test can lose exactly the
message it means to. Empty (the normal case), nothing is dropped. The transport's
counterpart for KV writes is the fault plan (transport/fault_plan.py).
"""
from __future__ import annotations

import logging
from typing import Mapping

from zpd.wire.protocol import MESSAGE_TYPES, Message

log = logging.getLogger("zpd.wire.drops")


class DropPlan:
    """How many more messages of each type to drop (by protocol type name).
    `source` names where the plan came from, in errors and in the log."""

    def __init__(self, counts: Mapping[str, int] | None = None, source: str = "drop plan") -> None:
        self.left = dict(counts or {})
        self.source = source
        unknown = sorted(set(self.left) - set(MESSAGE_TYPES))
        if unknown:
            raise ValueError(f"{source}: unknown message types {unknown}; known: "
                             f"{', '.join(sorted(MESSAGE_TYPES))}")

    @classmethod
    def parse(cls, text: str, source: str = "drop plan") -> "DropPlan":
        counts = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            name, _, n = item.partition(":")
            try:
                counts[name.strip()] = int(n) if n.strip() else 1
            except ValueError:
                raise ValueError(f"{source}: expected TYPE:COUNT[,TYPE:COUNT...], "
                                 f"got {text!r}") from None
        return cls(counts, source)

    def drops(self, msg: Message) -> bool:
        """True if `msg` is to be lost (and counts it)."""
        left = self.left.get(msg.TYPE, 0)
        if left <= 0:
            return False
        self.left[msg.TYPE] = left - 1
        log.warning("dropping outgoing %s on purpose (%s)", msg.TYPE, self.source)
        return True
