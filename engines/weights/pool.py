"""Shared staging memory for pushes on CPU: every parameter's staging copy, back to
back in the model's parameter order, in one anonymous shared file (a memfd) that a
weight-sync helper process maps once (zpd/worker/weights/helper.py) and receives
broadcasts straight into. A bucket whose tensors come in the model's order (a
trainer walking its own `named_parameters`, as slime's and SGLang's updaters do)
is one contiguous range of it, so it lands in place too.

The model's own parameters never live here: a commit copies from it, so that the
weights stay ordinary (resizable, releasable) memory of the model's."""
from __future__ import annotations

import itertools
import mmap
import os

import torch
from torch import nn

NAME = "zpd-weight-staging"
_KEYS = itertools.count(1)


class SharedPool:
    """One memfd holding a staging tensor per parameter; `fd` stays open (for the
    helpers) until `close`."""

    def __init__(self, model: nn.Module) -> None:
        self.key = next(_KEYS)          # which pool a helper was given
        self.offsets: dict[str, int] = {}
        at = 0
        for name, p in model.named_parameters():
            size = p.dtype.itemsize
            at = -(-at // size) * size                 # aligned for its own dtype only
            self.offsets[name] = at
            at += p.numel() * size
        self.size = max(at, 1)
        self.fd = os.memfd_create(NAME)
        try:
            os.ftruncate(self.fd, self.size)
            self.memory = mmap.mmap(self.fd, self.size)
        except OSError:
            os.close(self.fd)
            raise
        self.flat = torch.frombuffer(self.memory, dtype=torch.uint8)
        self.views = {name: self.flat[self.offsets[name]:self.offsets[name] + p.nbytes]
                      .view(p.dtype).view(p.shape) for name, p in model.named_parameters()}

    def offset_of(self, t: torch.Tensor) -> int | None:
        """Where contiguous `t` starts in the pool, None if it is not in it."""
        at = t.data_ptr() - self.flat.data_ptr()
        if t.device.type != "cpu" or not t.is_contiguous() or not 0 <= at <= self.size - t.nbytes:
            return None
        return at

    def close(self) -> None:
        """Give the fd back; the memory goes with the last tensor viewing it."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
