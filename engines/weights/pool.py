"""Shared staging memory for pushes on CPU: two slots per parameter, each half of
the pool holding every parameter back to back in the model's parameter order, in
one anonymous shared file (a memfd) that a weight-sync helper process maps once
(zpd/worker/weights/helper.py) and receives broadcasts straight into.

When a trainer group's staging copy (engines/weights/push.Shadow) is made, the
model's weights move into the pool (copied off the worker's loop, switched on it:
the memory stays the model's plus the staging copy's), and the staging copy takes, per parameter, the slot the
weight is not in; a commit hands the model that slot (no copy) and the staging
copy the other. Every page is written by the worker then, so a helper maps them
all at once (MAP_POPULATE) and a push takes no page faults. So after a whole push the staging copy is one half, back
to back: a bucket whose tensors come in the model's order (a trainer walking its
own `named_parameters`, as slime's and SGLang's updaters do) is one contiguous
range of it and lands in place too.

The memory of a slot nobody uses is given back (`punch`): the staging copy's when
it is dropped, a weight's when release_memory_occupation moves it out
(engines/weight_release.py calls `give_back`: the pool's memory cannot be resized
as torch's own can)."""
from __future__ import annotations

import itertools
import mmap
import os
import weakref

import torch
from torch import nn

from engines import weight_release

NAME = "zpd-weight-staging"
_KEYS = itertools.count(1)
_LIVE: "weakref.WeakSet[SharedPool]" = weakref.WeakSet()


class SharedPool:
    """One memfd with two slots per parameter of `model`; `fd` stays open for the
    helpers while the pool lives."""

    def __init__(self, model: nn.Module) -> None:
        self.key = next(_KEYS)          # which pool a helper was given
        params = dict(model.named_parameters())
        offsets, at = {}, 0
        for name, p in params.items():
            size = p.dtype.itemsize
            at = -(-at // size) * size                 # aligned for its own dtype only
            offsets[name] = at
            at += p.numel() * size
        self.half = -(-max(at, 1) // mmap.PAGESIZE) * mmap.PAGESIZE
        self.size = 2 * self.half
        self.fd = os.memfd_create(NAME)
        try:
            os.ftruncate(self.fd, self.size)
            self.memory = mmap.mmap(self.fd, self.size)
        except OSError:
            os.close(self.fd)
            raise
        self.flat = torch.frombuffer(self.memory, dtype=torch.uint8)
        self.slots = [{name: _slot(self.flat, h * self.half + offsets[name], p)
                       for name, p in params.items()} for h in (0, 1)]
        _LIVE.add(self)
        weakref.finalize(self, os.close, self.fd)

    def half_of(self, t: torch.Tensor) -> int | None:
        """Which half `t`'s memory is in, None if not in this pool."""
        if t.device.type != "cpu":
            return None
        at = t.data_ptr() - self.flat.data_ptr()
        return at // self.half if 0 <= at < self.size else None

    def offset_of(self, t: torch.Tensor) -> int | None:
        """Where contiguous `t` starts in the pool, None if it is not in it."""
        at = t.data_ptr() - self.flat.data_ptr()
        if t.device.type != "cpu" or not t.is_contiguous() or not 0 <= at <= self.size - t.nbytes:
            return None
        return at

    def punch(self, t: torch.Tensor) -> None:
        """Give back the whole pages under `t` (it reads as zeros afterwards)."""
        at = t.data_ptr() - self.flat.data_ptr()
        if t.device.type != "cpu" or not _dense(t) or not 0 <= at <= self.size - t.nbytes:
            return
        start = -(-at // mmap.PAGESIZE) * mmap.PAGESIZE
        end = (at + t.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
        if end > start:
            self.memory.madvise(mmap.MADV_REMOVE, start, end - start)


def _slot(flat: torch.Tensor, at: int, p: torch.Tensor) -> torch.Tensor:
    """`p`'s slot at byte `at`, laid out as `p` is (a column-major weight stays so)."""
    raw = flat[at:at + p.nbytes].view(p.dtype)
    return raw.as_strided(p.shape, p.stride()) if _dense(p) else raw.view(p.shape)


def _dense(p: torch.Tensor) -> bool:
    """Whether `p` fills its numel() elements exactly, in some order of its dims."""
    want = 1
    for size, stride in sorted(zip(p.shape, p.stride()), key=lambda d: d[1]):
        if size != 1 and stride != want:
            return False
        want *= size
    return True


def give_back(t: torch.Tensor) -> None:
    """Punch `t` in whichever live pool holds it (release_memory_occupation moved a
    weight out of it, engines/weight_release.py)."""
    for pool in list(_LIVE):
        if pool.half_of(t) is not None:
            pool.punch(t)
            return


weight_release.on_unresizable(give_back)
