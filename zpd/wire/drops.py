"""Losing control messages on purpose, for fault tests.

The environment variable ZPD_DROP_MESSAGES, read once when a worker starts, names
outgoing message types and how many of the first ones of each type to drop:

    ZPD_DROP_MESSAGES="kv_done:1"            the first kv_done this worker sends is lost
    ZPD_DROP_MESSAGES="kv_dest:2,kv_failed:1"

Every message a worker sends to a peer goes through `WorkerCore.send` or
`PrefillLink.send`, which ask `DropPlan.drops` first, so a test can lose exactly the
message it means to. Unset (the normal case), nothing is dropped. The transport's
counterpart for KV writes is ZPD_TRANSPORT_FAULT (transport/fault_plan.py).
"""
from __future__ import annotations

import logging
import os
from typing import Mapping

from zpd.wire.protocol import MESSAGE_TYPES, Message

DROP_ENV = "ZPD_DROP_MESSAGES"

log = logging.getLogger("zpd.wire.drops")


class DropPlan:
    """How many more messages of each type to drop (by protocol type name)."""

    def __init__(self, counts: Mapping[str, int] | None = None) -> None:
        self.left = dict(counts or {})
        unknown = sorted(set(self.left) - set(MESSAGE_TYPES))
        if unknown:
            raise ValueError(f"${DROP_ENV}: unknown message types {unknown}; known: "
                             f"{', '.join(sorted(MESSAGE_TYPES))}")

    @classmethod
    def parse(cls, text: str) -> "DropPlan":
        counts = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            name, _, n = item.partition(":")
            try:
                counts[name.strip()] = int(n) if n.strip() else 1
            except ValueError:
                raise ValueError(f"${DROP_ENV}: expected TYPE:COUNT[,TYPE:COUNT...], "
                                 f"got {text!r}") from None
        return cls(counts)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "DropPlan":
        return cls.parse((os.environ if environ is None else environ).get(DROP_ENV, ""))

    def drops(self, msg: Message) -> bool:
        """True if `msg` is to be lost (and counts it)."""
        left = self.left.get(msg.TYPE, 0)
        if left <= 0:
            return False
        self.left[msg.TYPE] = left - 1
        log.warning("dropping outgoing %s on purpose ($%s)", msg.TYPE, DROP_ENV)
        return True
