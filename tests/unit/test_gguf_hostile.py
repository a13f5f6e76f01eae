"""Hostile GGUF files (issue 30, items 9 and 10): every count in the header is checked
against a cap and against the bytes left in the file before it is used, so each file
below is refused with an error that names the problem, having allocated nothing that
grows with its counts (tracemalloc's peak), and a worker asked to load one answers 400."""
from __future__ import annotations

import struct
import tracemalloc
from pathlib import Path

import pytest

gguf = pytest.importorskip("gguf")   # imported now: its import is not the reader's cost

from engines.config import ModelError
from engines.formats.gguf_file import GGUFFile
from engines.formats.gguf_header import MAX_ARRAY, MAX_DEPTH, MAX_ELEMENTS, MAX_STRING, MAX_TENSORS
from tests.unit.gguf_files import (gguf_array, gguf_kv, gguf_string, gguf_tensor, raw_gguf,
                                   write_tiny_gguf)
from tests.unit.inproc import reference

U8, U32, STRING, ARRAY = 0, 4, 8, 9
SMALL = 1 << 20      # the most a refusal may allocate: far less than the counts declare
ARCH = gguf_kv("general.architecture", STRING, gguf_string("llama"))


def nested(depth: int) -> bytes:
    """An array of arrays `depth` deep, each holding one element."""
    value = gguf_array(U8, 1, b"\0")
    for _ in range(depth - 1):
        value = gguf_array(ARRAY, 1, value)
    return value


HOSTILE = {
    # a 2 MB file of such arrays once cost each worker 20 s and 1.4 GB
    "array past the file": ([ARCH, gguf_kv("x", ARRAY, gguf_array(U8, MAX_ARRAY))], {},
                            f"{MAX_ARRAY} elements in array 'x' cannot fit"),
    "array over the cap": ([gguf_kv("x", ARRAY, gguf_array(U8, MAX_ARRAY + 1))], {},
                           f"elements in array 'x'; at most {MAX_ARRAY}"),
    "strings past the file": ([gguf_kv("t", ARRAY, gguf_array(STRING, 100_000))], {},
                              "elements in array 't' cannot fit"),
    "string over the cap": ([gguf_kv("s", STRING, gguf_string("", MAX_STRING + 1))], {},
                            f"string metadata 's' of {MAX_STRING + 1} bytes; at most"),
    "string past the file": ([gguf_kv("s", STRING, gguf_string("abc", 1 << 40))], {},
                             "string metadata 's' of 1099511627776 bytes"),
    "key over the cap": ([gguf_string("k", 1 << 40) + bytes(16)], {}, "a metadata key of 1099511627776"),
    "key past the file": ([gguf_string("k", 4000) + bytes(16)], {}, "ends inside a metadata key"),
    "tensor count": ([ARCH], {"n_tensors": 1 << 40}, f"1099511627776 tensors; at most {MAX_TENSORS}"),
    "tensors past the file": ([ARCH], {"n_tensors": 1000}, "1000 tensors cannot fit"),
    "key count": ([ARCH], {"n_kv": 1 << 62}, "metadata keys; at most"),
    "nesting": ([ARCH, gguf_kv("n", ARRAY, nested(2000))], {},
                f"array 'n' nests arrays {MAX_DEPTH + 1} deep; at most {MAX_DEPTH}"),
    "value type": ([gguf_kv("v", 99, b"")], {}, "metadata 'v' has unknown value type 99"),
    "element type": ([gguf_kv("v", ARRAY, gguf_array(77, 1))], {}, "unknown element type 77"),
    "alignment": ([gguf_kv("general.alignment", U32, struct.pack("<I", 3))], {},
                  "general.alignment 3 is not a power of two"),
}
TENSORS = {
    "too many dims": ([gguf_tensor("w", [1] * 5)], "tensor 'w' has 5 dims; 1 to 4"),
    "dims overflow": ([gguf_tensor("w", [1 << 32] * 4)], "tensor 'w' has dims .* do not fit"),
    "zero dim": ([gguf_tensor("w", [4, 0])], "tensor 'w' has dims .* do not fit"),
    "type": ([gguf_tensor("w", [4], kind=1000)], "tensor 'w' has unknown type 1000"),
    "data past the file": ([gguf_tensor("w", [16, 16])], "tensor 'w' .* past the end of the file"),
    "offset past the file": ([gguf_tensor("w", [8], offset=1 << 40)], "past the end of the file"),
    "twice": ([gguf_tensor("w", [8]), gguf_tensor("w", [8], offset=32)], "tensor 'w' appears twice"),
}


def refused(path: Path, match: str) -> None:
    """GGUFFile(path) raises a ModelError naming the file and `match`, allocating little."""
    tracemalloc.start()
    try:
        with pytest.raises(ModelError, match=f"^{path}: not a readable GGUF file: .*{match}"):
            GGUFFile(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < SMALL, f"refusing took {peak} bytes"


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_header_is_refused_before_allocating(tmp_path, case):
    kvs, counts, match = HOSTILE[case]
    refused(raw_gguf(tmp_path / "h.gguf", kvs, **counts), match)


@pytest.mark.parametrize("case", sorted(TENSORS))
def test_a_hostile_tensor_is_refused_before_allocating(tmp_path, case):
    tensors, match = TENSORS[case]
    refused(raw_gguf(tmp_path / "t.gguf", [ARCH], tensors, tail=b"\0" * 64), match)


def test_all_arrays_together_are_capped(tmp_path):
    """Each element becomes a Python object: the arrays' total is capped too (the
    file's bytes are read, so here the cost grows with the file, not its counts)."""
    full = gguf_array(U8, MAX_ARRAY, bytes(MAX_ARRAY))
    kvs = [gguf_kv(f"x{i}", ARRAY, full) for i in range(MAX_ELEMENTS // MAX_ARRAY + 1)]
    path = raw_gguf(tmp_path / "e.gguf", kvs)
    with pytest.raises(ModelError, match=f"metadata arrays hold over {MAX_ELEMENTS} elements"):
        GGUFFile(path)


def test_a_big_endian_file_is_refused(tmp_path):
    """Its tensors would be read with the wrong byte order."""
    path = tmp_path / "be.gguf"
    path.write_bytes(b"GGUF" + struct.pack(">IQQ", 3, 0, 0))
    refused(path, "a big-endian GGUF file")


def test_duplicate_keys_and_bad_text_are_refused(tmp_path):
    refused(raw_gguf(tmp_path / "d.gguf", [ARCH, ARCH]), "'general.architecture' appears twice")
    refused(raw_gguf(tmp_path / "u.gguf", [gguf_kv("s", STRING, gguf_string(b"\xff"))]),
            "string metadata 's' is not UTF-8")


def test_the_caps_leave_real_files_alone(tmp_path):
    """The tiny model's file, its whole vocabulary and template, reads as before."""
    f = GGUFFile(write_tiny_gguf(tmp_path / "t.gguf"))
    assert len(f.meta["tokenizer.ggml.tokens"]) == 258
    assert {t.name for t in f.infos} >= {"token_embd.weight", "blk.0.attn_q.weight"}


@pytest.mark.parametrize("case", ["nesting", "array past the file"])
def test_a_worker_answers_400_to_a_hostile_file(cluster, tmp_path, case):
    """A nested file once raised RecursionError inside the gguf package: 500."""
    kvs, counts, match = HOSTILE[case]
    bad = raw_gguf(tmp_path / "bad.gguf", kvs, **counts)
    before = reference(cluster, [256, 70, 71], 4)
    reply = cluster.admin("update_weights", path=str(bad), version="v-bad")
    assert [w["status"] for w in reply["workers"]] == [400, 400]
    assert all(match.split(" at most")[0] in w["error"] for w in reply["workers"])
    assert cluster.decode.model.version == cluster.prefill.model.version == "tiny"
    assert cluster.run(cluster.submit([256, 70, 71], max_new=4)).token_ids == before
