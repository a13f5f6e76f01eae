"""Decoding SGLang's `serialized_named_tensors`: base64 of a torch
`ForkingPickler` dump of `[(name, tensor), ...]` whose tensors live in memory the
trainer shares (CPU shared memory, or CUDA IPC), so only handles travel.

A pickle is a program: unpickled as it comes it can call anything it names
(`os.system`, `builtins.eval`). `NamedTensorUnpickler.find_class` admits only what
torch's own reductions of a tensor name, and hands out checked wrappers of them:

- `rebuild_tensor`, `rebuild_typed_storage`, `rebuild_storage_empty`,
  `rebuild_storage_filename` (CPU tensors shared with the "file_system" strategy;
  the manager socket and the segment name must look like torch's own),
  `rebuild_storage_fd` (below) and `rebuild_cuda_tensor` (CUDA IPC), each with its
  arguments' types checked, and SGLang's patched CUDA rebuild
  (`_rebuild_cuda_tensor_modified`, the device named by its UUID) checked as torch's;
- torch dtypes and `torch.Size`, and the classes those functions take as an
  argument (`torch.Tensor`, `torch.nn.Parameter`, torch's storage classes) as
  inert markers: a pickle cannot call them (a `torch.Tensor(n)` or
  `UntypedStorage(n)` would allocate what the pickle asks).

SGLang's record classes are admitted by module and name and built as inert records
(engines/formats/sglang_records.py): `FlattenedTensorMetadata` (load format
"flattened_bucket": `{"flattened_tensor": T, "metadata": [...]}`, in SGLang 0.5's
byte layout or the older element one) and `LocalSerializedTensor` (verl's path:
per tensor, one nested dump per rank, each decoded by this same unpickler).

CPU tensors shared by file descriptor (torch's default strategy) arrive as
`multiprocessing.resource_sharer.DupFd`: received only where the sender hands the
descriptor over, i.e. to its own multiprocessing child (engines/formats/shared_fd.py);
anywhere else refused, naming the fix (the "file_system" strategy).

Everything else is refused naming it: arbitrary classes, torch.load's storage
loaders, any other global.

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
import os
import pickle
import re
from typing import Any

import torch
from torch.multiprocessing import reductions

from engines.formats.payload_checks import (PayloadError, dtype as _dtype,
                                            integer as _int, sizes as _ints)
from engines.formats.sglang_records import RECORDS, PerRank, unbucketed
from engines.formats.shared_fd import Detached, SharedFd, checked_fd_size, fd_argument

__all__ = ["MAX_PAYLOAD_CHARS", "NamedTensorUnpickler", "PayloadError", "decode_named_tensors"]

MAX_PAYLOAD_CHARS = 8 << 20     # one rank's base64 text; handles are ~200 bytes a tensor
_MANAGER = re.compile(rb"(/[\w.-]+)*/torch-shm-dir-\w+/manager\.sock")
_SEGMENT = re.compile(rb"/torch_\d+_\d+_\d+")
_UUID = re.compile(r"(GPU-)?[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


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
# SGLang's monkey_patch_torch_reductions: CUDA tensors rebuilt by a function of its
# own, the device given by its UUID (sglang/srt/utils/patch_torch.py; before 0.5,
# sglang/srt/patch_torch.py)
_SGLANG_CUDA = (("sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified"),
                ("sglang.srt.patch_torch", "_rebuild_cuda_tensor_modified"))
# torch's dtypes by the names they pickle as (read from the module's namespace: a
# getattr on torch could import a submodule the payload names)
_DTYPES = {k: v for k, v in vars(torch).items() if isinstance(v, torch.dtype)}


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


class NamedTensorUnpickler(pickle.Unpickler):
    """Unpickles one rank's `[(name, tensor), ...]`; `max_bytes` bounds the bytes all
    its storages map together (a nested LocalSerializedTensor dump's included)."""

    def __init__(self, data: bytes, max_bytes: int) -> None:
        super().__init__(io.BytesIO(data))
        self.left = max_bytes
        self.admitted: dict[tuple[str, str], Any] = {
            (_REDUCTIONS, "rebuild_tensor"): self._tensor,
            (_REDUCTIONS, "rebuild_typed_storage"): self._typed_storage,
            (_REDUCTIONS, "rebuild_storage_empty"): self._empty_storage,
            (_REDUCTIONS, "rebuild_storage_filename"): self._storage_filename,
            (_REDUCTIONS, "rebuild_storage_fd"): self._storage_fd,
            (_REDUCTIONS, "rebuild_cuda_tensor"): self._cuda_tensor,
            ("multiprocessing.resource_sharer", "DupFd"): SharedFd,
            ("torch", "Size"): torch.Size,
        } | {k: _Marker(v) for k, v in (_TENSORS | _STORAGES).items()} \
            | {k: self._sglang_cuda_tensor for k in _SGLANG_CUDA} | RECORDS

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self.admitted:
            return self.admitted[module, name]
        if module == "torch" and name in _DTYPES:
            return _DTYPES[name]
        raise PayloadError(f"the payload names {module}.{name}, which is not one of torch's "
                           "tensor or storage rebuild functions nor SGLang's weight records: "
                           "refused")

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

    def _storage_fd(self, cls: Any, df: Any, size: Any) -> Any:
        """torch's "file_descriptor" strategy (engines/formats/shared_fd.py)."""
        storage_cls, shared, size = _cls(cls, _STORAGES), fd_argument(df), _int("storage size", size)
        self._take(size)
        fd = shared.detach()
        try:
            checked_fd_size(fd, size)
        except PayloadError:
            os.close(fd)
            raise
        return reductions.rebuild_storage_fd(storage_cls, Detached(fd), size)   # closes fd

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

    def _sglang_cuda_tensor(self, *args: Any) -> torch.Tensor:
        """SGLang's patched reduction: torch's arguments, the device (7th) as a UUID."""
        if len(args) != 15:
            raise PayloadError(f"_rebuild_cuda_tensor_modified takes torch's 15 arguments, "
                               f"not {len(args)}")
        device = args[6]
        if isinstance(device, str):
            device = _device_of(device)
        return self._cuda_tensor(*args[:6], device, *args[7:])

    def _cuda_tensor(self, tensor_cls: Any, size: Any, stride: Any, offset: Any, storage_cls: Any,
                     dtype: Any, device: Any, handle: Any, storage_bytes: Any, storage_offset: Any,
                     requires_grad: Any, ref_handle: Any, ref_offset: Any, event_handle: Any,
                     event_sync: Any) -> torch.Tensor:
        if not torch.cuda.is_available():
            raise PayloadError("the payload holds CUDA tensors (CUDA IPC handles) and this "
                               "worker has no CUDA: send CPU tensors shared with the "
                               "\"file_system\" strategy")
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


def _device_of(uuid: str) -> int:
    """The index of the local GPU whose UUID SGLang's reduction wrote."""
    if not _UUID.fullmatch(uuid):
        raise PayloadError(f"device {uuid!r:.60} is neither an index nor a GPU UUID")
    if not torch.cuda.is_available():
        raise PayloadError("the payload holds CUDA tensors (CUDA IPC handles) and this worker "
                           "has no CUDA: send CPU tensors shared with the \"file_system\" "
                           "strategy")
    for index in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(index).uuid) == uuid.removeprefix("GPU-"):
            return index
    raise PayloadError(f"the payload's CUDA tensors are on GPU {uuid}, which this host lacks")


def _unpickled(data: bytes | str, max_bytes: int, what: str) -> tuple[Any, int]:
    """What one dump holds, and the bytes of the budget it left."""
    if isinstance(data, str):
        if not 0 < len(data) <= MAX_PAYLOAD_CHARS:
            raise PayloadError(f"{what} must be a base64 string of 1 to {MAX_PAYLOAD_CHARS} "
                               "characters")
        try:
            data = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            raise PayloadError(f"{what} is not base64") from None
    unpickler = NamedTensorUnpickler(data, max_bytes)
    try:
        return unpickler.load(), unpickler.left
    except PayloadError:
        raise
    except Exception as e:       # a malformed pickle raises anything; nothing was kept
        raise PayloadError(f"{what} is not a pickle of named tensors: "
                           f"{type(e).__name__}: {e}"[:300]) from None


def decode_named_tensors(payload: str, max_bytes: int, max_tensors: int, bucket: bool = False,
                         rank: int = 0, ranks: int = 1) -> list[tuple[str, torch.Tensor]]:
    """One rank's entry of `serialized_named_tensors`, as (name, tensor) pairs (with
    `bucket`, SGLang's "flattened_bucket" format, as views of the flat tensor). A
    LocalSerializedTensor gives this worker's value: the `rank`-th of `ranks`
    workers'. PayloadError says what is wrong; the tensors view the trainer's memory."""
    if not isinstance(payload, str):
        raise PayloadError("a serialized_named_tensors entry must be a base64 string")
    named, left = _unpickled(payload, max_bytes, "a serialized_named_tensors entry")
    if bucket:
        return unbucketed(named, max_tensors)
    out = []
    for name, tensor in _checked(named, max_tensors):
        if isinstance(tensor, PerRank):
            tensor, left = _unpickled(tensor.value(rank, ranks), left,
                                      f"LocalSerializedTensor {name!r:.60}")
            if not isinstance(tensor, torch.Tensor):
                raise PayloadError(f"LocalSerializedTensor {name!r:.60} holds "
                                   f"{type(tensor).__name__}, not a tensor")
        out.append((name, tensor))
    return out


def _checked(named: Any, max_tensors: int) -> list[tuple[str, torch.Tensor | PerRank]]:
    if isinstance(named, dict):                 # a dict of name -> tensor is taken too
        named = list(named.items())
    if not isinstance(named, (list, tuple)) or not 0 < len(named) <= max_tensors:
        raise PayloadError(f"the payload must be a list of 1 to {max_tensors} (name, tensor) pairs")
    out = []
    for pair in named:
        if (not isinstance(pair, (tuple, list)) or len(pair) != 2 or not isinstance(pair[0], str)
                or not isinstance(pair[1], (torch.Tensor, PerRank))):
            raise PayloadError(f"payload item {pair!r:.80} is not a (name, tensor) pair")
        out.append((pair[0], pair[1]))
    return out
