"""Releasing a model's weights from memory and restoring them bit for bit (SGLang's
release/resume_memory_occupation with the "weights" tag).

Each distinct storage behind the model's parameters is copied out as raw bytes, then
resized to nothing: the parameter tensors themselves stay (same objects, shapes and
strides, so every view, tied weight and reference held elsewhere stays valid) but
own no memory. Resuming resizes each storage back and copies the bytes in, so the
weights are exactly what they were (any dtype, any layout).

Where the bytes go while released:
- CUDA: a host (CPU) copy; the device memory goes back to the caching allocator,
  which is emptied.
- CPU: a file in a private temporary directory (0700, the file 0600), removed on
  resume; the freed heap is trimmed back to the kernel (glibc's malloc_trim), since
  zpd's allocator tuning keeps freed blocks in the heap otherwise.
Packed copies of weights (engines/cpu/linear.py) are dropped with them and rebuilt on
first use after resume.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from engines.cpu.linear import PackedWeights
from engines.models.moe import Experts

log = logging.getLogger("engines.weight_release")

CHUNK = 64 << 20        # bytes copied at a time between a storage and the spill file


@dataclass
class Released:
    """What `release` took away: the storages (emptied) and where their bytes are."""
    storages: list[torch.UntypedStorage]
    sizes: list[int]
    host: list[torch.Tensor] = field(default_factory=list)   # CUDA: one host copy each
    path: str | None = None                                   # CPU: the spill file

    @property
    def nbytes(self) -> int:
        return sum(self.sizes)


def _storages(net: nn.Module) -> list[torch.UntypedStorage]:
    """The distinct storages behind `net`'s parameters, in parameter order."""
    seen: dict[int, torch.UntypedStorage] = {}
    for p in net.parameters():
        s = p.untyped_storage()
        if s.nbytes() and s.data_ptr() not in seen:
            seen[s.data_ptr()] = s
    return list(seen.values())


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over all of `storage` (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _raw(storage: torch.UntypedStorage) -> memoryview:
    """A CPU storage's bytes as a memoryview (no copy). Not through numpy: a tensor that
    lent its memory to numpy can never be resized again."""
    return memoryview((ctypes.c_char * storage.nbytes()).from_address(storage.data_ptr())).cast("B")


def _drop_packed(net: nn.Module) -> None:
    for p in net.parameters():
        if hasattr(p, PackedWeights.ATTR):
            delattr(p, PackedWeights.ATTR)
    for m in net.modules():
        if isinstance(m, Experts):        # per-expert views, with packed copies of their own
            m.forget()


def trim_heap() -> None:
    """Give freed heap memory back to the kernel where the C library is glibc."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass


# Who holds weights in memory that cannot be resized (a weight-sync pool's,
# engines/weights/pool.py) registers here what gives a tensor's pages back.
_GIVE_BACK: list[Callable[[torch.Tensor], None]] = []


def on_unresizable(give_back: Callable[[torch.Tensor], None]) -> None:
    if give_back not in _GIVE_BACK:
        _GIVE_BACK.append(give_back)


def _unshare(net: nn.Module) -> None:
    """Move every CPU weight whose memory cannot be resized to memory of its own (its
    layout kept), and have that memory's owner give it back."""
    with torch.no_grad():
        for p in net.parameters():
            if p.device.type == "cpu" and not p.untyped_storage().resizable():
                old, p.data = p.data, p.data.clone()
                for give_back in _GIVE_BACK:
                    give_back(old)


def release(net: nn.Module, device: torch.device) -> Released:
    """Free the memory of `net`'s weights; `resume` with the result restores them.
    On an error nothing is released."""
    _unshare(net)          # weights in a push's shared memory: to memory torch can resize
    storages = _storages(net)
    held = Released(storages, [s.nbytes() for s in storages])
    if device.type == "cuda":
        held.host = [_bytes_of(s).to("cpu", copy=True) for s in storages]
    else:
        held.path = _spill(storages)
    _drop_packed(net)
    for s in storages:
        s.resize_(0)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    else:
        trim_heap()
    log.warning("released %d bytes of weights (%s)", held.nbytes,
                "host copy" if device.type == "cuda" else f"spilled to {held.path}")
    return held


def resume(held: Released) -> None:
    """Give every storage its bytes back, exactly as `release` found them. On an error
    (no memory for them, an unreadable spill file) they are all emptied again and `held`
    still has their bytes: the weights stay released, and a later resume can succeed."""
    try:
        for s, n in zip(held.storages, held.sizes):
            s.resize_(n)
        if held.host:
            for s, h in zip(held.storages, held.host):
                _bytes_of(s).copy_(h)
        elif held.path is not None:
            _unspill(held.storages, held.path)
    except BaseException:
        for s in held.storages:
            s.resize_(0)
        raise
    held.host = []
    if held.path is not None:
        shutil.rmtree(os.path.dirname(held.path), ignore_errors=True)
        held.path = None


def _spill(storages: list[torch.UntypedStorage]) -> str:
    """Write every storage's bytes, one after another, to a new private file."""
    folder = tempfile.mkdtemp(prefix="zpd-weights-")           # mode 0700
    path = os.path.join(folder, "weights.bin")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            for s in storages:
                data = _raw(s)
                for start in range(0, len(data), CHUNK):
                    f.write(data[start:start + CHUNK])
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return path


def _unspill(storages: list[torch.UntypedStorage], path: str) -> None:
    with open(path, "rb") as f:
        for s in storages:
            data = _raw(s)
            for start in range(0, len(data), CHUNK):
                view = data[start:start + CHUNK]
                if f.readinto(view) != len(view):
                    raise OSError(f"{path}: the spilled weights ended early")
