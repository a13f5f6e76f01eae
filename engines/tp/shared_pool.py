"""A follower rank's KV pool, seen by its leader too: rank 0 registers every rank's pool
with its transfer engine and writes and reads each rank's heads itself.

On the CPU a follower's pool lives in a file of shared memory (/dev/shm where there is
one) that the leader maps and then unlinks, so nothing is left behind once both exit.
On CUDA it is the follower's device memory, opened in the leader through a CUDA IPC
handle (torch.multiprocessing's). Either way the handle goes through the group's
rendezvous store under the rank's key.
"""
from __future__ import annotations

import os
import pickle
import tempfile
import uuid

import torch

SHM_DIR = "/dev/shm"


def _path() -> str:
    where = SHM_DIR if os.path.isdir(SHM_DIR) else tempfile.gettempdir()
    return os.path.join(where, f"zpd-kv-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def shared_buffer(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
                  ) -> tuple[torch.Tensor, bytes]:
    """A zeroed pool buffer the leader can open, and its handle."""
    if device.type == "cuda":
        from torch.multiprocessing.reductions import reduce_tensor
        buf = torch.zeros(shape, dtype=dtype, device=device)
        return buf, pickle.dumps(("cuda", reduce_tensor(buf)))
    path = _path()
    buf = torch.from_file(path, shared=True, size=_numel(shape), dtype=dtype).view(shape)
    return buf, pickle.dumps(("file", path, shape, str(dtype).removeprefix("torch.")))


def open_buffer(handle: bytes) -> torch.Tensor:
    """Leader: a follower's pool buffer from its handle (a file is unlinked once mapped)."""
    kind, *rest = pickle.loads(handle)
    if kind == "cuda":
        rebuild, args = rest[0]
        return rebuild(*args)
    path, shape, dtype = rest
    try:
        return torch.from_file(path, shared=True, size=_numel(shape),
                               dtype=getattr(torch, dtype)).view(shape)
    finally:
        os.unlink(path)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
