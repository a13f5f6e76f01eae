"""A finished request's routed experts on their way to its client: ``Rows``, the message
that carries them, and ``RowsInbox``, where a client keeps them until the request's
final tokens come.

The rows are too large for the final tokens' header (Qwen3-30B-A3B routes 384 experts
per position: 32k positions are 12.6M ids, 67 MB as SGLang's base64 int32), so the
worker that answers a request (its decode; the prefill of a scored prompt) sends them
compact (engines/routed_wire.py: uint8 ids, float32 weights) in a ``Rows`` of their
own just before that request's final tokens, in pieces of at most PIECE_BYTES, each a
frame of its own. The final tokens' meta then says how many ids it sent
(``ROWS_META``). The router passes a ``Rows`` on only from the worker that answers
the request, once, and only for a request that asked; the client, on the final part,
widens them to SGLang's fields (``RowsInbox.finish``), or, when they did not come
whole, ends that request with 500 naming them. Messages on one connection arrive in
order, so the rows are there before the part that needs them.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar, Optional

from engines.routed_wire import (ID_BYTES, MAX_PIECES, MAX_ROUTED_IDS, MAX_ROUTED_WEIGHTS,
                                 WEIGHT_BYTES, float32_base64, int32_base64, joined, pieces)
from zpd.wire.messages import Message, ProtocolError
from zpd.wire.tokens import TokenPart

__all__ = ["MAX_PIECES", "ROWS_META", "Rows", "RowsInbox"]

# The final part's meta key: the ids its worker sent ahead in a Rows (absent: none).
ROWS_META = "routed_values"


@dataclass(frozen=True, slots=True)
class Rows(Message):
    """Worker → router → client: request ``rid``'s routed experts, flat: ``ids``
    (little-endian ``dtype``: uint8, int16 or int32) and, where it asked, ``weights``
    (float32, as many), each in pieces (one wire frame each)."""

    TYPE: ClassVar[str] = "rows"
    rid: str
    dtype: str
    ids: list[bytes]
    weights: Optional[list[bytes]] = None

    def __post_init__(self) -> None:
        size = ID_BYTES.get(self.dtype)
        if size is None:
            raise ProtocolError(f"rows: ids of dtype {self.dtype!r:.40}, not one of {sorted(ID_BYTES)}")
        got = sum(map(len, self.ids))
        if got % size or got // size > MAX_ROUTED_IDS:
            raise ProtocolError(f"rows: {got} bytes of ids are not at most {MAX_ROUTED_IDS} "
                                f"{self.dtype}")
        if self.weights is not None and (sum(map(len, self.weights)) != got // size * WEIGHT_BYTES
                                         or got // size > MAX_ROUTED_WEIGHTS):
            raise ProtocolError(f"rows: weights are not float32, one per id, at most "
                                f"{MAX_ROUTED_WEIGHTS}")

    @classmethod
    def of(cls, rid: str, dtype: str, ids: bytes, weights: bytes | None) -> "Rows":
        """The rows of flat bytes, cut into pieces."""
        return cls(rid, dtype, pieces(ids), None if weights is None else pieces(weights))

    @property
    def values(self) -> int:
        """How many ids (and weights, if any) it carries."""
        return sum(map(len, self.ids)) // ID_BYTES[self.dtype]

    def fields(self) -> dict:
        """SGLang's meta fields: routed_experts, base64 of int32, and with weights
        routed_expert_weights, base64 of float32."""
        out = {"routed_experts": int32_base64(joined(self.ids), self.dtype)}
        if self.weights is not None:
            out["routed_expert_weights"] = float32_base64(joined(self.weights))
        return out


class RowsInbox:
    """A client's ``Rows`` of requests whose final part has not come yet (one each)."""

    def __init__(self) -> None:
        self.waiting: dict[str, Rows] = {}

    def take(self, msg: Rows) -> None:
        """Keep `msg` for its request's final part (the caller checked that the request
        is its own, from the router that has it)."""
        self.waiting[msg.rid] = msg

    def finish(self, part: TokenPart) -> TokenPart:
        """`part` as its client sees it: a final part that announces rows gets them as
        SGLang's meta fields, or, where they did not come whole, ends in 500 naming them
        (its tokens stay). Any part that ends a request forgets its rows."""
        if not part.finished:
            return part
        rows = self.waiting.pop(part.rid, None)
        if ROWS_META not in part.meta:
            return part
        meta = {k: v for k, v in part.meta.items() if k != ROWS_META}
        announced = part.meta[ROWS_META]
        if rows is None or rows.values != announced:
            got = "none" if rows is None else f"{rows.values}"
            return replace(part, meta=meta, finish={
                "type": "abort", "status_code": 500,
                "message": f"routed_experts: {announced} ids were sent, {got} arrived"})
        return replace(part, meta=meta | rows.fields())
