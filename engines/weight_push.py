"""Weights pushed by a trainer, tensor by tensor: what each announced tensor is
(checked against the model before a byte arrives), the staging memory it lands in,
and the copy into the model that happens only once every worker has received all.

A push announces `names`, `dtypes` and `shapes` (Hugging Face parameter names; the
parts of packed projections, q/k/v and gate/up, are placed in their rows). It may
cover any subset of the model's parameters. Its tensors come either one per
broadcast, or as one flat bucket: every tensor's bytes back to back in the order of
`names` (SGLang's "flattened_bucket" load format).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

import torch
from torch import nn

from engines.config import ModelError
from engines.weights import Placement, placement

# Names a trainer may give a dtype ("torch.bfloat16" as str(torch.bfloat16) prints too).
PUSH_DTYPES = {"float32": torch.float32, "float16": torch.float16,
               "bfloat16": torch.bfloat16, "float64": torch.float64}
MAX_TENSORS = 100_000
MAX_DIMS = 8


@dataclass(frozen=True)
class Announced:
    """One tensor a push announces; `where` is None for one the model does not use
    (a tied lm_head, rotary buffers): it is received and dropped."""
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    where: Placement | None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def push_dtype(name: object) -> torch.dtype:
    if isinstance(name, str) and name.removeprefix("torch.") in PUSH_DTYPES:
        return PUSH_DTYPES[name.removeprefix("torch.")]
    raise ModelError(f"dtype {name!r:.40} is not one of {', '.join(PUSH_DTYPES)}")


def sizes(names: list, dtypes: list, shapes: list) -> list[tuple[torch.dtype, tuple[int, ...]]]:
    """The dtype and shape of each announced tensor, parsed but not yet checked
    against a model: enough to receive (and drop) what a refused push sends."""
    if not (len(names) == len(dtypes) == len(shapes)):
        raise ModelError(f"names, dtypes and shapes differ in length "
                         f"({len(names)}, {len(dtypes)}, {len(shapes)})")
    if not names or len(names) > MAX_TENSORS:
        raise ModelError(f"a push names 1 to {MAX_TENSORS} tensors, not {len(names)}")
    out = []
    for name, dtype, shape in zip(names, dtypes, shapes):
        if not isinstance(shape, (list, tuple)) or len(shape) > MAX_DIMS or not all(
                isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**40 for d in shape):
            raise ModelError(f"tensor {name!r:.200}: shape {shape!r:.80} is not a list of "
                             f"at most {MAX_DIMS} sizes")
        out.append((push_dtype(dtype), tuple(shape)))
    return out


def announce(model: nn.Module, names: list, dtypes: list, shapes: list) -> list[Announced]:
    """Every announced tensor, checked against `model`; ModelError names the first
    that does not fit (unknown name, wrong shape, dtype that is not floating, a name
    twice). Nothing is allocated here."""
    params = dict(model.named_parameters())
    seen: set[str] = set()
    out = []
    for name, (dtype, shape) in zip(names, sizes(names, dtypes, shapes)):
        if not isinstance(name, str) or not name:
            raise ModelError(f"tensor name {name!r:.60} is not a non-empty string")
        if name in seen:
            raise ModelError(f"tensor {name!r:.200} is named twice")
        seen.add(name)
        try:
            where = placement(model, name)
        except AttributeError:
            raise ModelError(f"tensor {name!r:.200} does not belong to this model") from None
        if where is not None:
            pname, _, rows = where
            if pname not in params:
                raise ModelError(f"tensor {name!r:.200} does not belong to this model")
            want = params[pname].shape if rows < 0 else (rows, *params[pname].shape[1:])
            if tuple(shape) != tuple(want):
                raise ModelError(f"tensor {name!r:.200} has shape {tuple(shape)}, the model "
                                 f"expects {tuple(want)}")
        out.append(Announced(name, dtype, shape, where))
    return out


def push_limit(model: nn.Module) -> int:
    """The most bytes one push may announce: every parameter in float64, twice
    (a tied head sent anyway, rotary buffers) -- beyond that it is not for this model."""
    return 2 * 8 * sum(p.numel() for p in model.parameters()) + (64 << 20)


def bucket_dtype(items: list[Announced]) -> torch.dtype:
    """The dtype a flat bucket travels as: its tensors' one dtype, else bytes."""
    kinds = {a.dtype for a in items}
    return kinds.pop() if len(kinds) == 1 else torch.uint8


def unflatten(flat: torch.Tensor, items: list[Announced]) -> list[torch.Tensor]:
    """The tensors of a received flat bucket (views of it, no copy)."""
    raw, out, at = flat.view(torch.uint8), [], 0
    for a in items:
        out.append(raw[at:at + a.nbytes].view(a.dtype).view(a.shape))
        at += a.nbytes
    return out


@torch.inference_mode()
def apply_pushed(model: nn.Module, staged: Iterable[tuple[Announced, torch.Tensor]]) -> int:
    """Copy staged tensors into the model (converted to its dtype and device);
    returns the elements written. Called only after every tensor has arrived."""
    params = dict(model.named_parameters())
    written = 0
    for a, tensor in staged:
        if a.where is None:
            continue
        pname, start, rows = a.where
        target = params[pname] if rows < 0 else params[pname][start:start + rows]
        target.copy_(tensor)
        written += tensor.numel()
    return written
