"""The receiving side of trainer weight sync, in a helper process of its own (one
per joined group; zpd/worker/weights/helper_link.py starts, drives and kills it).

Why a process: gloo aborts the whole process (SIGABRT from C++, which Python cannot
catch) when a broadcast carries more bytes than the receiving tensor holds, and torch
ignores its timeout while a trainer's address accepts and never answers. Here either
costs only this helper: the worker sees it die or overstay, kills it, and keeps
serving with its old weights.

The helper joins the trainer's group as the worker's rank (trainer_group.py), then
receives each push into memory the worker maps too: on CPU straight into the
worker's staging copy of the weights (engines/weights/pool.py: one memfd, mapped
here once), or, for a tensor that cannot land in place (another dtype than the
model's, one the model drops, a refused push), into a memfd of the push's own; on
CUDA tensors of its own on the worker's device, handed over by CUDA IPC
(torch.multiprocessing's reductions) and held until the worker has copied them.
The CUDA path is written but not run by the test suite (no GPU there).

The last element of every receive buffer is filled with 0xFF bytes first. All-ones
is a NaN in every IEEE float format, and a little-endian element whose last (most
significant) byte is still 0xFF was not received whole: gloo writes a short
broadcast as a prefix, so a trainer that sends fewer bytes than it announced leaves
the last element so, and the tensor is refused by name. A received tensor is then
summed: a finite sum means no NaN (nor inf) anywhere, the common case, one read of
its bytes. Otherwise every element is looked at: one whose top byte is 0xFF is -inf,
a NaN or beyond 2^127 in magnitude (float16: -inf or NaN), refused as well; so is
any NaN.

Messages are pickled tuples on the worker's pipe (the worker is the only peer):
in ("join", ...), ("pool", size) and its fd, ("stage", ...) [and a scratch fd],
("release",); out ("joined",), ("error", text), ("got", index, problem | None[, cuda
tensor]), ("staged",).
"""
from __future__ import annotations

import ctypes
import mmap
import os
import signal
import sys
import time
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle

import torch
import torch.multiprocessing  # noqa: F401  (registers the CUDA IPC reductions)

from zpd.worker.weights.trainer_group import GroupError, TrainerGroup, join_group

FILL = 0xFF
GRACE_S = 1.0       # torch's own timeouts end this much after the worker's, which kills first
PR_SET_PDEATHSIG = 1


def main(conn: Connection, device: str) -> None:
    """The helper's whole life: join, then stage pushes until told to stop or killed."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)     # the worker decides when it ends
    _die_with_parent()
    torch.set_num_threads(1)
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    group, pool = None, None           # pool: the worker's staging memory, mapped once
    held: list[torch.Tensor] = []      # what the worker maps by CUDA IPC, until it releases it
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):                   # the worker is gone
            return
        if msg[0] == "join":
            try:
                group = join_group(*msg[1:])
                conn.send(("joined",))
            except GroupError as e:
                conn.send(("error", str(e)))
                return
        elif msg[0] == "pool":
            pool = _map(conn, msg[1])
        elif msg[0] == "stage":
            held[:] = _stage(conn, group, pool, *msg[1:])
        elif msg[0] == "release":
            held.clear()
        else:
            return


def _map(conn: Connection, size: int) -> torch.Tensor:
    """The worker's staging memory (engines/weights/pool.py), its fd passed next."""
    fd = recv_handle(conn)
    try:
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)    # no faults in a push
        return torch.frombuffer(mmap.mmap(fd, size, flags=flags), dtype=torch.uint8)
    finally:
        os.close(fd)


def _die_with_parent() -> None:
    """A helper whose worker (or the worker's forkserver) died goes too (Linux)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        except (OSError, AttributeError):
            pass


def _stage(conn: Connection, group: TrainerGroup, pool: torch.Tensor | None,
           metas: list[tuple[str, str, tuple, str, int, int]], bucket: tuple | None,
           seconds: float, scratch: int) -> list[torch.Tensor]:
    """Receive one push. `metas`: (name, dtype, shape, where, offset, nbytes) per tensor,
    `where` "pool" (in place, in the staging memory mapped by `pool`) or "scratch" (a
    memory of this push's, `scratch` bytes, passed now); `bucket`: (dtype, where,
    offset) of the one flat broadcast they all travel in (None: one broadcast each).
    Answers per tensor, then ("staged",); returns what the worker still maps."""
    deadline = time.monotonic() + seconds + GRACE_S
    cuda = group.device.type == "cuda"
    try:
        if cuda:
            flat = torch.full((max(scratch, 1),), FILL, dtype=torch.uint8, device=group.device)
        elif scratch:
            fd = recv_handle(conn)
            memory = mmap.mmap(fd, scratch)
            os.close(fd)
            flat = torch.frombuffer(memory, dtype=torch.uint8)
        else:
            flat = None
        spaces = {"pool": pool, "scratch": flat}
        parts = [spaces[where][offset:offset + nbytes] for _, _, _, where, offset, nbytes in metas]
        for (_, dtype, _, _, _, _), raw in zip(metas, parts):
            mark(raw, getattr(torch, dtype))
        if bucket is not None:
            dtype, where, offset = bucket
            total = sum(m[5] for m in metas)
            group.receive(spaces[where][offset:offset + total].view(getattr(torch, dtype)),
                          deadline)
        for i, ((name, dtype, shape, _, _, _), raw) in enumerate(zip(metas, parts)):
            if bucket is None:
                group.receive(raw.view(getattr(torch, dtype)).view(shape), deadline)
            problem = check(name, raw, getattr(torch, dtype))
            conn.send(("got", i, problem) + ((raw,) if cuda else ()))
    except GroupError as e:
        conn.send(("error", str(e)))
        return []
    if cuda:
        torch.cuda.current_stream().synchronize()
    conn.send(("staged",))
    return [flat] if cuda else []


def mark(raw: torch.Tensor, dtype: torch.dtype) -> None:
    """FILL the last element of a receive buffer: a broadcast that ends short of it
    leaves its top byte so (gloo writes a short broadcast as a prefix). The rest is
    not filled: a full pass over every byte costs about as much as receiving them."""
    if raw.numel() >= dtype.itemsize:
        raw[-dtype.itemsize:] = FILL


def check(name: str, raw: torch.Tensor, dtype: torch.dtype) -> str | None:
    """Why tensor `name`, received into `raw` (bytes whose last element was FILLed,
    `mark`), must not be staged; None if it arrived whole. The common case costs one
    read: a last element received and a finite sum (no NaN anywhere); else every
    element is looked at."""
    size = dtype.itemsize
    if raw.numel() == 0:
        return None
    values = raw if raw.data_ptr() % size == 0 else raw.clone()
    if raw[-1] != FILL and bool(torch.isfinite(values.view(dtype).sum())):
        return None
    top = raw.view(-1, size)[:, size - 1] == FILL          # little-endian: the top byte
    if bool(top.any()):
        first = int(top.nonzero()[0, 0])
        if bool((raw[(first + 1) * size:] == FILL).all()):      # a prefix arrived
            return (f"tensor {name!r}: fewer than {(first + 1) * size} of its {raw.numel()} "
                    "bytes arrived (the trainer broadcast fewer bytes than it announced)")
        return f"tensor {name!r}: element {first} is -inf, NaN or beyond 2^127 in magnitude"
    if bool(torch.isnan(values.view(dtype)).any()):
        return f"tensor {name!r} holds NaN"
    return None
