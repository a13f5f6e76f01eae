"""Rooms a prefill ended recently, so a late message for them is not taken as new work.

A request's messages reach the prefill on two sockets (the router's generate, the
decode's kv_dest and kv_failed) in any order. Once a (room, epoch) has ended here,
a generate or kv_dest for it that was still on the way must not start it again; the
tombstone says so until every such message has surely arrived (`seconds`).
"""
from __future__ import annotations

from zpd.wire.loop import Loop, Timer


class Tombstones:
    def __init__(self, loop: Loop, seconds: float) -> None:
        self.loop, self.seconds = loop, seconds
        self.by_room: dict[int, tuple[int, Timer]] = {}   # room -> (last ended epoch, expiry)

    def add(self, room: int, epoch: int) -> None:
        old = self.by_room.get(room)
        if old is not None:
            old[1].cancel()
        self.by_room[room] = (epoch, self.loop.call_later(self.seconds, self.by_room.pop, room, None))

    def __contains__(self, key: tuple[int, int]) -> bool:
        """(room, epoch) ended here, or an older epoch of a room that did."""
        tomb = self.by_room.get(key[0])
        return tomb is not None and key[1] <= tomb[0]
