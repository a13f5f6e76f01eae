"""A GGUF file's header, read with a bound on every count before it is trusted.

The `gguf` package's reader trusts the file: it loops over a metadata array's
declared length making two numpy views per element (even past the end of the
file), recurses into arrays of arrays without a limit, and sizes tensors from
their declared dims. A 2 MB file in the weights directory cost each worker 20 s and
1.4 GB (issue 30, item 9); a deeply nested one raised RecursionError (a 500). Even a
real vocabulary cost 2.8 s (SmolLM2's 150,000 metadata elements). Here every count
is checked against a cap and against the bytes left in the file before it is used,
numeric arrays are read in one numpy call, and tensors are views of the memory-mapped
file: a hostile header is refused having allocated nothing that grows with a count.
The caps are far above any real model's (vocabularies: at most 262,144 tokens;
tensors: a few thousand; dims: four).
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MAX_KV = 1 << 16            # metadata keys
MAX_TENSORS = 1 << 16
MAX_ARRAY = 1 << 20         # elements of one metadata array
MAX_ELEMENTS = 1 << 22      # elements of all metadata arrays together (each a Python object)
MAX_STRING = 1 << 24        # bytes of one string (chat templates: tens of KB)
MAX_NAME = 1 << 12          # bytes of a key or a tensor name
MAX_DEPTH = 2               # an array of arrays, no deeper
MAX_DIMS = 4                # ggml's GGML_MAX_DIMS
VERSIONS = (2, 3)           # what llama.cpp writes today
DEFAULT_ALIGNMENT = 32

# GGUF value types (gguf's GGUFValueType) -> struct code; 8 is a string, 9 an array
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
           12: "d"}
STRING, ARRAY, UINT32 = 8, 9, 4
MIN_SIZE = {k: struct.calcsize(v) for k, v in SCALARS.items()} | {STRING: 8, ARRAY: 12}


class BadHeader(ValueError):
    """Why the header is refused; the caller names the file."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]        # ggml's order: innermost dim first
    tensor_type: Any              # gguf.GGMLQuantizationType
    data: np.ndarray              # its bytes (uint8), a view of the mapped file


@dataclass(frozen=True)
class Header:
    meta: dict[str, Any]          # key -> int, float, bool, str or list of them
    tensors: list[TensorInfo]


def read_header(path: Path) -> Header:
    """The metadata and tensors of GGUF file `path`; BadHeader for any count past its
    cap or past the end of the file."""
    buf = np.memmap(path, mode="r") if path.stat().st_size else np.zeros(0, np.uint8)
    return _Cursor(buf).header()


class _Cursor:
    """Reads the header in order; never past the end of the file."""

    def __init__(self, buf: np.ndarray) -> None:
        self.buf, self.pos, self.order = buf, 0, "<"      # little-endian only
        self.elements = 0       # metadata array elements so far

    @property
    def left(self) -> int:
        return len(self.buf) - self.pos

    def header(self) -> Header:
        self._need(8, "the file's magic and version")
        if bytes(self.buf[:4]) != b"GGUF":
            raise BadHeader("GGUF magic invalid")
        self.pos = 4
        version = self._scalar(UINT32, "the version")
        if version & 0xFFFF == 0:             # written on a machine of the other byte order
            # its tensors would need byte-swapping too, which nothing here does
            raise BadHeader("a big-endian GGUF file; convert it on a little-endian machine")
        if version not in VERSIONS:
            raise BadHeader(f"version {version}; readable: {', '.join(map(str, VERSIONS))}")
        tensors, kvs = self._scalar(10, "the tensor count"), self._scalar(10, "the key count")
        self._within("tensors", tensors, MAX_TENSORS, 8 + 4 + 8 + 4 + 8)  # name dim type offset
        self._within("metadata keys", kvs, MAX_KV, 8 + 4 + 1)             # key, type, a byte
        meta: dict[str, Any] = {}
        for _ in range(kvs):
            key, value = self._field()
            if key in meta:
                raise BadHeader(f"metadata {key!r} appears twice")
            meta[key] = value
        infos = [self._tensor_info() for _ in range(tensors)]
        return Header(meta, self._place(infos, meta.get("general.alignment", DEFAULT_ALIGNMENT)))

    # --- primitives ---------------------------------------------------------------

    def _need(self, n: int, what: str) -> None:
        if n > self.left:
            raise BadHeader(f"the file ends inside {what} (truncated or corrupt?)")

    def _scalar(self, kind: int, what: str) -> Any:
        code = SCALARS[kind]
        self._need(MIN_SIZE[kind], what)
        (value,) = struct.unpack_from(self.order + code, self.buf, self.pos)
        self.pos += MIN_SIZE[kind]
        return value

    def _string(self, cap: int, what: str) -> str:
        n = self._scalar(10, what)
        if n > cap:
            raise BadHeader(f"{what} of {n} bytes; at most {cap}")
        self._need(n, what)
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise BadHeader(f"{what} is not UTF-8") from None

    def _within(self, what: str, count: int, cap: int, each: int) -> None:
        """`count` items of at least `each` bytes: under the cap and inside the file."""
        if count > cap:
            raise BadHeader(f"{count} {what}; at most {cap}")
        if count * each > self.left:
            raise BadHeader(f"{count} {what} cannot fit in the {self.left} bytes left")

    # --- metadata -----------------------------------------------------------------

    def _field(self) -> tuple[str, Any]:
        key = self._string(MAX_NAME, "a metadata key")
        value = self._value(self._scalar(UINT32, f"metadata {key!r}"), key, 0)
        if key == "general.alignment" and (type(value) is not int or value <= 0
                                           or value & (value - 1)):
            raise BadHeader(f"general.alignment {value!r} is not a power of two")
        return key, value

    def _value(self, kind: int, key: str, depth: int) -> Any:
        what = f"metadata {key!r}"
        if kind in SCALARS:
            return self._scalar(kind, what)
        if kind == STRING:
            return self._string(MAX_STRING, f"string {what}")
        if kind == ARRAY:
            return self._array(key, depth + 1)
        raise BadHeader(f"{what} has unknown value type {kind}")

    def _array(self, key: str, depth: int) -> list:
        what = f"array {key!r}"
        if depth > MAX_DEPTH:
            raise BadHeader(f"{what} nests arrays {depth} deep; at most {MAX_DEPTH}")
        kind, count = self._scalar(UINT32, what), self._scalar(10, what)
        if kind not in MIN_SIZE:
            raise BadHeader(f"{what} has unknown element type {kind}")
        self._within(f"elements in {what}", count, MAX_ARRAY, MIN_SIZE[kind])
        self.elements += count
        if self.elements > MAX_ELEMENTS:
            raise BadHeader(f"metadata arrays hold over {MAX_ELEMENTS} elements in all")
        if kind in SCALARS:                   # one numpy call, however long
            dtype = np.dtype(SCALARS[kind]).newbyteorder(self.order)
            values = np.frombuffer(self.buf, dtype, count, self.pos).tolist()
            self.pos += count * MIN_SIZE[kind]
            return values
        # bounded: count * MIN_SIZE[kind] bytes are in the file
        return [self._value(kind, key, depth) for _ in range(count)]

    # --- tensors ------------------------------------------------------------------

    def _tensor_info(self) -> tuple[str, tuple[int, ...], Any, int, int]:
        """One tensor's name, shape, type, offset in the data section and bytes."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType   # lazily, as gguf_file does

        name = self._string(MAX_NAME, "a tensor name")
        what = f"tensor {name!r}"
        n_dims = self._scalar(UINT32, what)
        if not 1 <= n_dims <= MAX_DIMS:
            raise BadHeader(f"{what} has {n_dims} dims; 1 to {MAX_DIMS}")
        shape = tuple(self._scalar(10, what) for _ in range(n_dims))
        elements = int(np.prod(shape, dtype=object))     # Python ints: no overflow
        if 0 in shape or elements > 8 * len(self.buf):  # no type stores an element in under a bit
            raise BadHeader(f"{what} has dims {list(shape)} that do not fit in the file")
        raw_type = self._scalar(UINT32, what)
        try:
            kind = GGMLQuantizationType(raw_type)
            block, size = GGML_QUANT_SIZES[kind]
        except (ValueError, KeyError):
            raise BadHeader(f"{what} has unknown type {raw_type}") from None
        if shape[0] % block:
            raise BadHeader(f"{what}: rows of {shape[0]} are not whole blocks of {block}")
        return name, shape, kind, self._scalar(10, what), elements // block * size

    def _place(self, infos: list, alignment: int) -> list[TensorInfo]:
        start = -(-self.pos // alignment) * alignment
        placed, names = [], set()
        for name, shape, kind, offset, nbytes in infos:
            if name in names:
                raise BadHeader(f"tensor {name!r} appears twice")
            names.add(name)
            begin = start + offset
            if offset % alignment or begin + nbytes > len(self.buf):
                raise BadHeader(f"tensor {name!r} ({nbytes} bytes at {offset}) is misaligned "
                                "or lies past the end of the file")
            placed.append(TensorInfo(name, shape, kind, self.buf[begin:begin + nbytes]))
        return placed
