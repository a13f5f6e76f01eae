"""SGLang's record classes as a weight payload pickles them, admitted by module and
name (engines/formats/tensor_payload.py) and built as inert records of ours:

- `FlattenedTensorMetadata` (sglang.srt.weight_sync.tensor_bucket), one entry of a
  "flattened_bucket" payload `{"flattened_tensor": T, "metadata": [...]}` with the
  fields name, shape, dtype, start_idx, end_idx, numel. Two layouts are in use:
  SGLang from 0.5 (its FlattenedTensorBucket with `supports_multi_dtypes`) views
  every tensor as bytes, so T is uint8 and start_idx, end_idx and numel count bytes;
  before, T had the tensors' one dtype and they counted elements.
- `LocalSerializedTensor` (sglang.srt.model_executor.model_runner before SGLang
  0.5.16, model_runner_components.weight_updater since), what sglang's
  `weight_sync.utils.update_weights` (verl's path) sends in place of a tensor: its
  field `values` holds one MultiprocessingSerializer dump of the tensor per rank of
  the server as the trainer sees it; rank r takes values[r].
"""
from __future__ import annotations

import math
from typing import Any

import torch

from engines.formats.payload_checks import PayloadError, Record, dtype, integer, sizes


class BucketEntry(Record):
    """A pickled FlattenedTensorMetadata: its six fields, nothing run."""
    FIELDS = ("name", "shape", "dtype", "start_idx", "end_idx", "numel")
    PICKLED_AS = "FlattenedTensorMetadata"


class PerRank(Record):
    """A pickled LocalSerializedTensor: one serialized tensor per rank."""
    FIELDS = ("values",)
    PICKLED_AS = "LocalSerializedTensor"

    def value(self, rank: int, ranks: int) -> bytes | str:
        """Rank `rank`'s dump (of `ranks` in this server): values[rank], or the only one."""
        values = self.field("values")
        if not isinstance(values, list) or not all(isinstance(v, (bytes, str)) for v in values):
            raise PayloadError("LocalSerializedTensor.values must be a list of serialized tensors")
        if len(values) == 1:
            return values[0]
        if len(values) != ranks:
            raise PayloadError(f"LocalSerializedTensor has {len(values)} values: give one (every "
                               f"worker takes it) or one per worker ({ranks})")
        return values[rank]


RECORDS: dict[tuple[str, str], type[Record]] = {
    ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"): BucketEntry,
    ("sglang.srt.model_executor.model_runner", "LocalSerializedTensor"): PerRank,
    ("sglang.srt.model_executor.model_runner_components.weight_updater",
     "LocalSerializedTensor"): PerRank,
}


def unbucketed(bucket: Any, max_tensors: int) -> list[tuple[str, torch.Tensor]]:
    """{"flattened_tensor", "metadata"} -> (name, view of the flat tensor) pairs: each
    entry's slice [start_idx, end_idx) of it, in its dtype and shape."""
    if not isinstance(bucket, dict) or set(bucket) != {"flattened_tensor", "metadata"}:
        raise PayloadError('a flattened_bucket entry must be {"flattened_tensor", "metadata"}')
    flat, metadata = bucket["flattened_tensor"], bucket["metadata"]
    if not isinstance(flat, torch.Tensor) or flat.dim() != 1 or not flat.is_contiguous():
        raise PayloadError("flattened_tensor must be a contiguous 1-D tensor")
    if not isinstance(metadata, list) or not 0 < len(metadata) <= max_tensors:
        raise PayloadError(f"metadata must be a list of 1 to {max_tensors} entries")
    out, left = [], flat.numel()      # the entries share the flat tensor, never reuse it
    for entry in metadata:
        if not isinstance(entry, BucketEntry):
            raise PayloadError(f"bucket metadata {entry!r:.60} is not FlattenedTensorMetadata")
        name, start, end = _span(entry, flat)
        left -= end - start
        if left < 0:
            raise PayloadError("the bucket's entries cover more than its flat tensor")
        out.append((name, _view(name, flat[start:end], dtype(entry.field("dtype")),
                                sizes("shape", entry.field("shape")))))
    return out


def _span(entry: BucketEntry, flat: torch.Tensor) -> tuple[str, int, int]:
    """The entry's name and [start, end) in the flat tensor, checked against its
    shape: in bytes of a uint8 bucket (SGLang 0.5), else in elements."""
    name, kind = entry.field("name"), dtype(entry.field("dtype"))
    shape = sizes("shape", entry.field("shape"))
    start = integer("start_idx", entry.field("start_idx"), 0, flat.numel())
    end = integer("end_idx", entry.field("end_idx"), start, flat.numel())
    numel = integer("numel", entry.field("numel"))
    if not isinstance(name, str):
        raise PayloadError(f"bucket entry name {name!r:.60} is not a string")
    unit = kind.itemsize if flat.dtype == torch.uint8 else 1
    if math.prod(shape) * unit != numel:
        raise PayloadError(f"bucket entry {name!r:.60}: shape {shape} of {kind} does not hold "
                           f"{numel} {'bytes' if unit > 1 else 'elements'}")
    if end - start != numel:
        raise PayloadError(f"bucket entry {name!r:.60}: [{start}, {end}) does not fit its "
                           f"{numel} {'bytes' if unit > 1 else 'elements'}")
    return name, start, end


def _view(name: str, part: torch.Tensor, kind: torch.dtype, shape: tuple[int, ...]
          ) -> torch.Tensor:
    try:
        if part.dtype != torch.uint8 and part.dtype != kind:
            return part.to(kind).view(shape)     # the element layout's cast, as SGLang's
        try:
            return part.view(kind).view(shape)
        except RuntimeError:         # an offset not aligned to the dtype: a copy
            return part.clone().view(kind).view(shape)
    except RuntimeError as e:
        raise PayloadError(f"bucket entry {name!r:.60} cannot be viewed as {kind} {shape}: "
                           f"{e}") from None
