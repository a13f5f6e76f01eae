"""Decoding SGLang's `serialized_named_tensors`: base64 of a torch
`ForkingPickler` dump of `[(name, tensor), ...]` whose tensors live in memory the
trainer shares (CPU shared memory, or CUDA IPC), so only handles travel.

A pickle is a program: unpickled as it comes it can call anything it names
(`os.system`, `builtins.eval`). `NamedTensorUnpickler.find_class` admits only what
torch's own reductions of a tensor name, and hands out checked wrappers of them:

- `rebuild_tensor`, `rebuild_typed_storage`, `rebuild_storage_empty`, and
  `rebuild_storage_filename` (CPU tensors shared with the "file_system" strategy;
  the manager socket and the segment name must look like torch's own) and
  `rebuild_cuda_tensor` (CUDA IPC), each with its arguments' types checked;
- torch dtypes and `torch.Size`, and the classes those functions take as an
  argument (`torch.Tensor`, `torch.nn.Parameter`, torch's storage classes) as
  inert markers: a pickle cannot call them (a `torch.Tensor(n)` or
  `UntypedStorage(n)` would allocate what the pickle asks).

With SGLang's load format "flattened_bucket" an entry is instead
`{"flattened_tensor": T, "metadata": [FlattenedTensorMetadata(name, shape, dtype,
start_idx, end_idx, numel), ...]}`: a class named FlattenedTensorMetadata (SGLang's,
or a framework's copy of it) unpickles as `BucketEntry`, an inert record of ours.

Everything else is refused naming it: arbitrary classes, torch.load's storage
loaders, and `multiprocessing.resource_sharer.DupFd`, what torch's default
"file_descriptor" strategy sends (the worker would connect to a socket the payload
names, with credentials it does not have).

The memory the handles name is on the trainer's host: the worker must run there
(SGLang's colocated mode). The bytes every storage maps, and the tensor count, are
bounded by the caller. A payload can name any torch shared-memory segment on the
host, so the route that takes it is admin-key guarded. Mapping a "file_system"
segment connects the worker to the trainer's torch_shm_manager, and torch's libshm
keeps that connection (and so that manager process) for the worker's life.
"""
from __future__ import annotations

import base64
import binascii
import io
import math
import pickle
import re
from typing import Any

import torch
from torch.multiprocessing import reductions

MAX_PAYLOAD_CHARS = 8 << 20     # one rank's base64 text; handles are ~200 bytes a tensor
_MANAGER = re.compile(rb"(/[\w.-]+)*/torch-shm-dir-\w+/manager\.sock")
_SEGMENT = re.compile(rb"/torch_\d+_\d+_\d+")
_FILE_SYSTEM_HINT = ("call torch.multiprocessing.set_sharing_strategy(\"file_system\") in the "
                     "trainer before serializing")


class PayloadError(ValueError):
    """The payload is not SGLang's serialized named tensors, or asks for more than
    is allowed: refused, nothing mapped is kept."""


class _Marker:
    """A class a pickle names as an argument of a rebuild function; not callable."""

    def __init__(self, cls: type) -> None:
        self.cls = cls

    def __repr__(self) -> str:
        return f"<{self.cls.__module__}.{self.cls.__qualname__}>"


_TENSORS = {("torch", "Tensor"): torch.Tensor,
            ("torch.nn.parameter", "Parameter"): torch.nn.Parameter,
            ("torch.nn", "Parameter"): torch.nn.Parameter}
_STORAGES = {("torch.storage", "UntypedStorage"): torch.UntypedStorage,
             ("torch", "UntypedStorage"): torch.UntypedStorage,
             ("torch.storage", "TypedStorage"): torch.TypedStorage,
             ("torch", "TypedStorage"): torch.TypedStorage}
_REDUCTIONS = "torch.multiprocessing.reductions"
# torch's dtypes by the names they pickle as (read from the module's namespace: a
# getattr on torch could import a submodule the payload names)
_DTYPES = {k: v for k, v in vars(torch).items() if isinstance(v, torch.dtype)}


class BucketEntry:
    """What a pickled FlattenedTensorMetadata becomes: its six fields, nothing run."""
    FIELDS = ("name", "shape", "dtype", "start_idx", "end_idx", "numel")

    def __init__(self, *args: Any) -> None:
        if args:
            raise PayloadError("FlattenedTensorMetadata is built from its state, not called")

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2 and state[1] is None:
            state = state[0]                      # (dict, slots) as a dataclass may pickle
        if not isinstance(state, dict) or set(state) - set(self.FIELDS):
            raise PayloadError(f"FlattenedTensorMetadata state {state!r:.80} has other fields")
        self.__dict__.update(state)


def _int(name: str, value: Any, low: int = 0, high: int = 1 << 48) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise PayloadError(f"{name} must be an integer in [{low}, {high}], not {value!r:.40}")
    return value


def _ints(name: str, value: Any) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or len(value) > 16:
        raise PayloadError(f"{name} must be a tuple of at most 16 sizes, not {value!r:.60}")
    return tuple(_int(name, v) for v in value)


def _cls(value: Any, admitted: dict) -> type:
    if not isinstance(value, _Marker) or value.cls not in admitted.values():
        names = sorted(c.__name__ for c in admitted.values())
        raise PayloadError(f"{value!r:.60} is not one of {names}")
    return value.cls


def _fits(offset: int, size: tuple[int, ...], stride: tuple[int, ...], elements: int) -> None:
    """The view lies inside its storage (torch's set_ would grow a storage too small)."""
    if len(size) != len(stride):
        raise PayloadError(f"tensor size {size} and stride {stride} differ in length")
    if 0 not in size and offset + sum((n - 1) * s for n, s in zip(size, stride)) >= elements:
        raise PayloadError(f"tensor of size {size}, stride {stride} at offset {offset} does not "
                           f"fit its storage of {elements} elements")


def _dtype(value: Any) -> torch.dtype:
    if not isinstance(value, torch.dtype):
        raise PayloadError(f"dtype {value!r:.40} is not a torch dtype")
    return value


class NamedTensorUnpickler(pickle.Unpickler):
    """Unpickles one rank's `[(name, tensor), ...]`; `max_bytes` bounds the bytes all
    its storages map together."""

    def __init__(self, data: bytes, max_bytes: int) -> None:
        super().__init__(io.BytesIO(data))
        self.left = max_bytes
        self.admitted: dict[tuple[str, str], Any] = {
            (_REDUCTIONS, "rebuild_tensor"): self._tensor,
            (_REDUCTIONS, "rebuild_typed_storage"): self._typed_storage,
            (_REDUCTIONS, "rebuild_storage_empty"): self._empty_storage,
            (_REDUCTIONS, "rebuild_storage_filename"): self._storage_filename,
            (_REDUCTIONS, "rebuild_cuda_tensor"): self._cuda_tensor,
            ("torch", "Size"): torch.Size,
        } | {k: _Marker(v) for k, v in (_TENSORS | _STORAGES).items()}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self.admitted:
            return self.admitted[module, name]
        if name == "FlattenedTensorMetadata":
            return BucketEntry
        if module == "torch" and name in _DTYPES:
            return _DTYPES[name]
        if name in ("DupFd", "rebuild_storage_fd"):
            raise PayloadError(f"the payload names {module}.{name}: its CPU tensors were "
                               f"shared by file descriptor, which this server cannot receive; "
                               f"{_FILE_SYSTEM_HINT}")
        raise PayloadError(f"the payload names {module}.{name}, which is not one of torch's "
                           "tensor or storage rebuild functions: refused")

    def persistent_load(self, pid: Any) -> Any:
        raise PayloadError("the payload uses persistent ids (torch.save's format): refused")

    def _take(self, nbytes: int) -> None:
        if nbytes > self.left:
            raise PayloadError("the payload's tensors map more bytes than this model could take")
        self.left -= nbytes

    # --- the admitted rebuild functions, their arguments checked ---------------------

    def _storage_filename(self, cls: Any, manager: Any, handle: Any, size: Any,
                          dtype: Any = None) -> Any:
        storage_cls = _cls(cls, _STORAGES)
        if not isinstance(manager, bytes) or not _MANAGER.fullmatch(manager) or b"/../" in manager:
            raise PayloadError(f"shared-memory manager {manager!r:.80} is not torch's")
        if not isinstance(handle, bytes) or not _SEGMENT.fullmatch(handle):
            raise PayloadError(f"shared-memory segment {handle!r:.80} is not torch's")
        size = _int("storage size", size)
        self._take(size * (_dtype(dtype).itemsize if dtype is not None else 1))
        return reductions.rebuild_storage_filename(storage_cls, manager, handle, size,
                                                   None if dtype is None else _dtype(dtype))

    def _empty_storage(self, cls: Any) -> Any:
        return _cls(cls, _STORAGES)()

    def _typed_storage(self, storage: Any, dtype: Any) -> Any:
        if not isinstance(storage, torch.UntypedStorage):
            raise PayloadError(f"rebuild_typed_storage of {type(storage).__name__}, not a storage")
        return reductions.rebuild_typed_storage(storage, _dtype(dtype))

    def _tensor(self, cls: Any, storage: Any, metadata: Any) -> torch.Tensor:
        tensor_cls = _cls(cls, _TENSORS)
        if not isinstance(storage, torch.TypedStorage):
            raise PayloadError(f"rebuild_tensor of {type(storage).__name__}, not a typed storage")
        if (not isinstance(metadata, tuple) or len(metadata) != 4
                or not isinstance(metadata[3], bool)):
            raise PayloadError(f"tensor metadata {metadata!r:.80} is not (offset, size, stride, "
                               "requires_grad)")
        offset, size, stride = _int("offset", metadata[0]), _ints("size", metadata[1]), \
            _ints("stride", metadata[2])
        _fits(offset, size, stride, storage._untyped_storage.nbytes() // storage.dtype.itemsize)
        try:
            return reductions.rebuild_tensor(tensor_cls, storage,
                                             (offset, torch.Size(size), stride, metadata[3]))
        except RuntimeError as e:
            raise PayloadError(f"tensor does not fit its storage: {e}") from None

    def _cuda_tensor(self, tensor_cls: Any, size: Any, stride: Any, offset: Any, storage_cls: Any,
                     dtype: Any, device: Any, handle: Any, storage_bytes: Any, storage_offset: Any,
                     requires_grad: Any, ref_handle: Any, ref_offset: Any, event_handle: Any,
                     event_sync: Any) -> torch.Tensor:
        if not torch.cuda.is_available():
            raise PayloadError("the payload holds CUDA tensors and this worker has no CUDA")
        for name, value in (("storage handle", handle), ("ref-counter handle", ref_handle),
                            ("event handle", event_handle)):
            if value is not None and not isinstance(value, bytes):
                raise PayloadError(f"{name} {value!r:.40} is not bytes")
        if not isinstance(requires_grad, bool) or not isinstance(event_sync, bool):
            raise PayloadError("requires_grad and event_sync_required must be booleans")
        self._take(_int("storage size", storage_bytes))
        _fits(_int("offset", offset), _ints("size", size), _ints("stride", stride),
              storage_bytes // _dtype(dtype).itemsize)
        args = (_cls(tensor_cls, _TENSORS), torch.Size(_ints("size", size)),
                _ints("stride", stride),
                _int("offset", offset), _cls(storage_cls, _STORAGES), _dtype(dtype),
                _int("device", device, 0, 1024), handle, storage_bytes,
                _int("storage offset", storage_offset), requires_grad, ref_handle,
                _int("ref-counter offset", ref_offset), event_handle, event_sync)
        try:
            return reductions.rebuild_cuda_tensor(*args)
        except RuntimeError as e:
            raise PayloadError(f"CUDA IPC tensor could not be opened: {e}") from None


def decode_named_tensors(payload: str, max_bytes: int, max_tensors: int,
                         bucket: bool = False) -> list[tuple[str, torch.Tensor]]:
    """One rank's entry of `serialized_named_tensors`, as (name, tensor) pairs (with
    `bucket`, SGLang's "flattened_bucket" format, as views of the flat tensor).
    PayloadError says what is wrong; the tensors view the trainer's memory."""
    if not isinstance(payload, str) or not 0 < len(payload) <= MAX_PAYLOAD_CHARS:
        raise PayloadError(f"a serialized_named_tensors entry must be a base64 string of 1 to "
                           f"{MAX_PAYLOAD_CHARS} characters")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise PayloadError("a serialized_named_tensors entry is not base64") from None
    try:
        named = NamedTensorUnpickler(data, max_bytes).load()
    except PayloadError:
        raise
    except Exception as e:       # a malformed pickle raises anything; nothing was kept
        raise PayloadError(f"a serialized_named_tensors entry is not a pickle of named tensors: "
                           f"{type(e).__name__}: {e}"[:300]) from None
    return _unbucketed(named, max_tensors) if bucket else _checked(named, max_tensors)


def _field(entry: Any, name: str) -> Any:
    value = entry.get(name) if isinstance(entry, dict) else getattr(entry, name, None)
    if value is None:
        raise PayloadError(f"bucket metadata {entry!r:.60} lacks {name!r}")
    return value


def _unbucketed(bucket: Any, max_tensors: int) -> list[tuple[str, torch.Tensor]]:
    """{"flattened_tensor", "metadata"} -> (name, view of the flat tensor) pairs: each
    entry's slice [start_idx, end_idx) of it, viewed as its dtype, in its shape."""
    if not isinstance(bucket, dict) or set(bucket) != {"flattened_tensor", "metadata"}:
        raise PayloadError('a flattened_bucket entry must be {"flattened_tensor", "metadata"}')
    flat, metadata = bucket["flattened_tensor"], bucket["metadata"]
    if not isinstance(flat, torch.Tensor) or flat.dim() != 1 or not flat.is_contiguous():
        raise PayloadError("flattened_tensor must be a contiguous 1-D tensor")
    if not isinstance(metadata, list) or not 0 < len(metadata) <= max_tensors:
        raise PayloadError(f"metadata must be a list of 1 to {max_tensors} entries")
    out, left = [], flat.numel()      # the entries share the flat tensor, never reuse it
    for entry in metadata:
        if not isinstance(entry, (BucketEntry, dict)):
            raise PayloadError(f"bucket metadata {entry!r:.60} is not FlattenedTensorMetadata")
        name, dtype = _field(entry, "name"), _dtype(_field(entry, "dtype"))
        shape = _ints("shape", _field(entry, "shape"))
        start = _int("start_idx", _field(entry, "start_idx"), 0, flat.numel())
        end = _int("end_idx", _field(entry, "end_idx"), start, flat.numel())
        numel = _int("numel", _field(entry, "numel"))
        if not isinstance(name, str) or math.prod(shape) != numel:
            raise PayloadError(f"bucket entry {name!r:.60}: shape {shape} does not hold {numel}")
        left -= end - start
        if left < 0:
            raise PayloadError("the bucket's entries cover more than its flat tensor")
        part = flat[start:end]
        try:
            try:
                out.append((name, part.view(dtype).view(shape)))
            except RuntimeError:         # an offset not aligned to the dtype: a copy
                out.append((name, part.clone().view(dtype).view(shape)))
        except RuntimeError as e:
            raise PayloadError(f"bucket entry {name!r:.60} does not fit [{start}, {end}) of "
                               f"the flat tensor: {e}") from None
    return out


def _checked(named: Any, max_tensors: int) -> list[tuple[str, torch.Tensor]]:
    if isinstance(named, dict):                 # a dict of name -> tensor is taken too
        named = list(named.items())
    if not isinstance(named, (list, tuple)) or not 0 < len(named) <= max_tensors:
        raise PayloadError(f"the payload must be a list of 1 to {max_tensors} (name, tensor) pairs")
    out = []
    for pair in named:
        if (not isinstance(pair, (tuple, list)) or len(pair) != 2 or not isinstance(pair[0], str)
                or not isinstance(pair[1], torch.Tensor)):
            raise PayloadError(f"payload item {pair!r:.80} is not a (name, tensor) pair")
        out.append((pair[0], pair[1]))
    return out

