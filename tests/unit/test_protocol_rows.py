"""Codec tests of the routed experts' rows (zpd/wire/rows.py): pieces larger than a
frame, rows that do not add up, the answer's limit, and the ids widened to SGLang's
int32 at the edges. The other messages: test_protocol.py."""

from __future__ import annotations

import struct

import orjson
import pytest

from zpd.wire import protocol as p
from zpd.wire.protocol import ProtocolError, decode, encode


# --- pieces: routed experts larger than a frame (zpd/wire/rows.py) ---------------------

def test_pieces_travel_as_frames_untouched() -> None:
    msg = p.Rows.of("r", "uint8", bytes(range(256)) * 3, None)
    assert [len(x) for x in msg.ids] == [768]
    cut = p.Rows("r", "int16", [b"\1\0" * 3, b"\2\0"], [struct.pack("<4f", 1, 2, 3, 4)])
    frames = encode(cut)
    assert len(frames) == 4 and frames[1:3] == cut.ids and orjson.loads(frames[0])["ids"] == [0, 2]
    assert decode(frames) == cut and cut.values == 4


@pytest.mark.parametrize("pieces,why", [
    ([0, 3], "out of range"),             # more frames than there are
    ([0, 0], "out of range"),             # no piece at all
    ([-1, 1], "out of range"),
    ([0, p.MAX_PIECES + 1], "out of range"),
    (0, "first index, count"),            # a blob index, not pieces
    ([0, 1, 2], "first index, count"),
])
def test_bad_pieces_are_protocol_errors(pieces, why) -> None:
    head = {"v": p.PROTOCOL_VERSION, "type": "rows", "rid": "r", "dtype": "uint8", "ids": pieces}
    with pytest.raises(ProtocolError, match=why):
        decode([orjson.dumps(head), b"\1\2"])


@pytest.mark.parametrize("fields,why", [
    (dict(dtype="int64", ids=[b"\0" * 8]), "dtype"),
    (dict(dtype="int16", ids=[b"\0" * 3]), "ids"),                           # half an id
    (dict(dtype="uint8", ids=[b"\0" * 3], weights=[b"\0" * 8]), "weights"),  # 2 weights, 3 ids
    (dict(dtype="uint8", ids=[b"\0" * 4] * 2, weights=[b"\0" * 4]), "weights"),
])
def test_rows_that_do_not_add_up_are_protocol_errors(fields, why) -> None:
    with pytest.raises(ProtocolError, match=why):
        p.Rows("r", **fields)
    head = {"v": p.PROTOCOL_VERSION, "type": "rows", "rid": "r", "dtype": fields["dtype"],
            "ids": [0, len(fields["ids"])]}
    frames = list(fields["ids"])
    if "weights" in fields:
        head["weights"] = [len(frames), len(fields["weights"])]
        frames += fields["weights"]
    with pytest.raises(ProtocolError, match=why):
        decode([orjson.dumps(head), *frames])


def test_more_ids_than_an_answer_may_have_are_protocol_errors(monkeypatch) -> None:
    import zpd.wire.rows as rows
    monkeypatch.setattr(rows, "MAX_ROUTED_IDS", 7)
    p.Rows("r", "uint8", [bytes(7)])
    with pytest.raises(ProtocolError, match="at most 7"):
        p.Rows("r", "uint8", [bytes(4), bytes(4)])


@pytest.mark.parametrize("dtype", ["uint8", "int16", "int32"])
def test_ids_widen_to_sglangs_int32(dtype) -> None:
    """What the client and the HTTP front answer (engines/routed_wire.py): base64 of
    little-endian int32, whatever the ids travelled as."""
    import base64

    import numpy as np

    from engines.routed_wire import int32_base64
    top = {"uint8": 256, "int16": 1 << 15, "int32": 70_000}[dtype]      # ids are never negative
    ids = np.random.default_rng(0).integers(0, top, 999).astype(np.dtype(dtype).newbyteorder("<"))
    got = np.frombuffer(base64.b64decode(int32_base64(ids.tobytes(), dtype)), "<i4")
    assert (got == ids).all() and got.dtype.itemsize == 4
    msg = decode(encode(p.Rows.of("r", dtype, ids.tobytes(), None)))
    assert msg.fields() == {"routed_experts": int32_base64(ids.tobytes(), dtype)}
