"""Routed experts as bytes (engines/routed.py has the rows themselves): how they travel
inside zpd, compact, and how the edges widen them to SGLang's answer. No torch here:
the client and the HTTP front widen with this alone.

Ids are below num_experts, so inside zpd they travel as the narrowest little-endian
integer that holds them (uint8 up to 256 experts, every served model; int16 up to
32,768), a quarter of SGLang's int32; weights travel as float32. Only the answer
(`zpd run`'s, zpd.Client's, /generate's) widens the ids to SGLang's base64 of int32.
A value array larger than one piece travels as several (`pieces`), each well inside
the wire's 16 MiB frame (zpd/wire/protocol.py MAX_FRAME_BYTES).
"""
from __future__ import annotations

import base64

# The most ids (positions x layers x experts per token) one request may ask for, and
# the most weights (return_routed_expert_weights), budgeted apart: 2^25 ids are 32 MiB
# as uint8, 171 MiB of base64 int32 in the answer (Qwen3-30B-A3B's 48 x 8 per position:
# 87,381 positions; GLM-4.5's 92 x 8: 45,590); 2^24 weights are 64 MiB of float32
# (43,690 and 22,795 positions).
MAX_ROUTED_IDS = 1 << 25
MAX_ROUTED_WEIGHTS = 1 << 24

# One piece of a value array: its own wire frame, a quarter of the 16 MiB a frame may be.
PIECE_BYTES = 4 << 20
# The most pieces one array may come in: the largest, 2^25 int32 ids, is 32 of them.
MAX_PIECES = 32

# wire name -> bytes per id, narrowest first
ID_BYTES = {"uint8": 1, "int16": 2, "int32": 4}
WEIGHT_BYTES = 4                      # float32


def id_dtype(num_experts: int) -> str:
    """The narrowest wire dtype of ids below `num_experts`."""
    if num_experts <= 256:
        return "uint8"
    return "int16" if num_experts <= 1 << 15 else "int32"


def pieces(data: bytes | bytearray | memoryview, piece_bytes: int = PIECE_BYTES) -> list[bytes]:
    """`data` cut into frames of at most `piece_bytes` (at least one, maybe empty)."""
    view = memoryview(data)
    return [bytes(view[i:i + piece_bytes]) for i in range(0, max(len(view), 1), piece_bytes)]


def joined(parts: list[bytes]) -> bytes:
    return parts[0] if len(parts) == 1 else b"".join(parts)


def int32_base64(ids: bytes, dtype: str) -> str:
    """SGLang's routed_experts: base64 of little-endian int32, from ids in `dtype` (ids
    are never negative, so the high bytes are zeros)."""
    size = ID_BYTES[dtype]
    if size == 4:
        return base64.b64encode(ids).decode("ascii")
    wide = bytearray(len(ids) // size * 4)
    for byte in range(size):                 # each id's bytes into its int32's low bytes
        wide[byte::4] = ids[byte::size]
    return base64.b64encode(wide).decode("ascii")


def float32_base64(weights: bytes) -> str:
    """routed_expert_weights: base64 of the little-endian float32 the wire carries."""
    return base64.b64encode(weights).decode("ascii")
