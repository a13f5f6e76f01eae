"""A follower rank's KV pool, seen by its leader too: rank 0 registers every rank's pool
with its transfer engine and writes and reads each rank's heads itself.

On the CPU a follower's pool lives in a file of shared memory (/dev/shm where there is
one) that the leader maps and then unlinks, so nothing is left behind once both exit
(`remove_files` clears what a failure or a killed rank left). On CUDA it is the
follower's device memory, opened in the leader through a CUDA IPC handle. Either way
the handle goes through the group's rendezvous store under the rank's key, as a JSON
record that is checked field by field (issue 43: it used to be a pickle, which runs
whatever it names): a file must be one of ours in the shared-memory folder, a CUDA
handle is rebuilt only as torch's own rebuild of a plain tensor.
"""
from __future__ import annotations

import glob
import os
import re
import stat
import tempfile
import uuid

import orjson
import torch

SHM_DIR = "/dev/shm"
PREFIX = "zpd-kv-"
_NAME = re.compile(rf"{PREFIX}(\d+)-[0-9a-f]{{8}}")
# The dtypes a KV pool may have (engines/kv/pool.py takes the model's).
DTYPES = {name: getattr(torch, name) for name in ("float32", "float16", "bfloat16", "float64")}
MAX_DIMS = 8


class HandleError(ValueError):
    """A pool handle that is not one a follower of ours made."""


def _folder() -> str:
    return SHM_DIR if os.path.isdir(SHM_DIR) else tempfile.gettempdir()


def _path() -> str:
    return os.path.join(_folder(), f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}")


def shared_buffer(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
                  ) -> tuple[torch.Tensor, bytes]:
    """A zeroed pool buffer the leader can open, and its handle. A failure leaves no file."""
    if device.type == "cuda":
        buf = torch.zeros(shape, dtype=dtype, device=device)
        return buf, _cuda_handle(buf)
    path = _path()
    try:
        buf = torch.from_file(path, shared=True, size=_numel(shape), dtype=dtype).view(shape)
    except BaseException:
        _unlink(path)
        raise
    record = {"kind": "file", "path": path, "shape": list(shape),
              "dtype": str(dtype).removeprefix("torch.")}
    return buf, orjson.dumps(record)


def open_buffer(handle: bytes) -> torch.Tensor:
    """Leader: a follower's pool buffer from its handle (a file is unlinked once mapped).
    A HandleError for anything but a record `shared_buffer` makes."""
    try:
        record = orjson.loads(handle)
    except orjson.JSONDecodeError:
        raise HandleError("a pool handle is a JSON record") from None
    if not isinstance(record, dict):
        raise HandleError("a pool handle is a JSON record")
    if record.get("kind") == "cuda":
        return _open_cuda(record)
    if record.get("kind") != "file" or set(record) != {"kind", "path", "shape", "dtype"}:
        raise HandleError("a pool handle names a file or a CUDA allocation")
    shape, dtype = _shape(record["shape"]), _dtype(record["dtype"])
    path = _our_file(record["path"], _numel(shape) * dtype.itemsize)
    try:
        return torch.from_file(path, shared=True, size=_numel(shape), dtype=dtype).view(shape)
    finally:
        _unlink(path)


def remove_files(pid: int) -> list[str]:
    """Unlink the pool files rank process `pid` made that nobody mapped and unlinked
    (it died, or a resume failed half way); returns their paths."""
    paths = glob.glob(os.path.join(_folder(), f"{PREFIX}{int(pid)}-*"))
    for path in paths:
        _unlink(path)
    return paths


def _our_file(path: object, nbytes: int) -> str:
    """`path` if it is a pool file a rank of ours made: in the shared-memory folder,
    named as `_path` names them, a regular file (no link) of this user, of `nbytes`."""
    if not isinstance(path, str) or os.path.dirname(path) != _folder() \
            or not _NAME.fullmatch(os.path.basename(path)):
        raise HandleError(f"{str(path)[:200]!r} is not a pool file")
    try:
        st = os.lstat(path)
    except OSError as e:
        raise HandleError(f"pool file {path}: {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_size != nbytes:
        raise HandleError(f"{path} is not a pool file of this user of {nbytes} bytes")
    return path


def _shape(v: object) -> tuple[int, ...]:
    if not (isinstance(v, list) and 0 < len(v) <= MAX_DIMS and all(type(n) is int and n >= 0 for n in v)):
        raise HandleError("a pool's shape is a list of sizes")
    return tuple(v)


def _dtype(v: object) -> torch.dtype:
    if v not in DTYPES:
        raise HandleError(f"a pool's dtype is one of {sorted(DTYPES)}")
    return DTYPES[v]


def _cuda_handle(buf: torch.Tensor) -> bytes:
    """torch's own CUDA IPC description of `buf` (torch.multiprocessing's reduce_tensor),
    its byte strings in hex."""
    from torch.multiprocessing.reductions import reduce_tensor
    _, (_, size, stride, offset, _, dtype, device, handle, nbytes, storage_offset,
        _, ref_handle, ref_offset, event, event_sync) = reduce_tensor(buf)
    return orjson.dumps({"kind": "cuda", "size": list(size), "stride": list(stride),
                         "offset": offset, "dtype": str(dtype).removeprefix("torch."),
                         "device": device, "handle": handle.hex(), "nbytes": nbytes,
                         "storage_offset": storage_offset, "ref_handle": ref_handle.hex(),
                         "ref_offset": ref_offset, "event": event.hex() if event else None,
                         "event_sync": bool(event_sync)})


CUDA_FIELDS = {"kind", "size", "stride", "offset", "dtype", "device", "handle", "nbytes",
               "storage_offset", "ref_handle", "ref_offset", "event", "event_sync"}


def _open_cuda(r: dict) -> torch.Tensor:
    """A CUDA IPC handle's tensor, through torch's rebuild with only the plain tensor and
    storage classes (no class or function the record names is ever called)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor
    if set(r) != CUDA_FIELDS:
        raise HandleError("a CUDA pool handle has exactly torch's IPC fields")
    ints = ("offset", "device", "nbytes", "storage_offset", "ref_offset")
    if not all(type(r[k]) is int and r[k] >= 0 for k in ints) or type(r["event_sync"]) is not bool:
        raise HandleError("a CUDA pool handle's offsets and sizes are integers")
    try:
        handle, ref = bytes.fromhex(r["handle"]), bytes.fromhex(r["ref_handle"])
        event = None if r["event"] is None else bytes.fromhex(r["event"])
    except (TypeError, ValueError):
        raise HandleError("a CUDA pool handle's handles are hex strings") from None
    return rebuild_cuda_tensor(torch.Tensor, _shape(r["size"]), _shape(r["stride"]), r["offset"],
                               torch.storage.TypedStorage, _dtype(r["dtype"]), r["device"], handle,
                               r["nbytes"], r["storage_offset"], False, ref, r["ref_offset"],
                               event, r["event_sync"])


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
