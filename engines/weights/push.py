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
import torch
from torch import nn
from torch.autograd.graph import increment_version

from engines.config import ModelError
from engines.formats.weights import Placement, checked_placement
from engines.weights.pool import SharedPool

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
        out.append(Announced(name, dtype, shape, checked_placement(model, params, name, shape)))
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


class Shadow:
    """A second copy of the model's parameters that pushes are received into, so a
    push neither touches the model before its commit nor allocates memory each time.
    Committing swaps each fully written parameter with the model's own (the old
    weights become the next push's staging area) and copies the rows of a partly
    written one (in a SharedPool, the swap is of the pool's two slots). A swapped
    parameter's version goes up: its memory alternates between two places, and what
    is cached by address and version (packed copies, engines/cpu/linear.py) must not
    be taken for the new values when it comes back to one. Made once
    per trainer group, on `device` (the model's, unless the group's backend cannot
    reach it)."""

    def __init__(self, model: nn.Module, device: torch.device, blank: bool = False,
                 pool: SharedPool | None = None) -> None:
        """`blank`: zeros of the parameters' shapes, not their values (`model` may then be
        on the meta device: a tensor-parallel rank's template of the whole model, whose
        commit applies only the rows a push wrote, engines/tp/runner.py). `pool` (made
        for `model`, on CPU): the copy takes the slots the weights are not in, for a
        helper process to receive into (engines/weights/pool.py); weights not in the
        pool yet are copied into its first slots, to move there by `adopt`."""
        self.params = dict(model.named_parameters())
        self.pool = pool if device.type == "cpu" else None
        with torch.no_grad():
            self.moving: dict[str, tuple[int, int]] = {}      # see `adopt`
            if self.pool is not None:
                for n, p in self.params.items():
                    if p.device.type == "cpu" and self.pool.half_of(p) is None:
                        self.pool.slots[0][n].copy_(p.detach())
                        self.moving[n] = (p.data_ptr(), p._version)
                self.copy = {n: self.pool.slots[1 - (self.pool.half_of(p) or 0)][n]
                             for n, p in self.params.items()}
                if not blank:
                    for n, p in self.params.items():
                        self.copy[n].copy_(p.detach())
            else:
                self.copy = {n: torch.zeros(p.shape, dtype=p.dtype, device=device) if blank
                             else p.detach().to(device, copy=True)
                             for n, p in self.params.items()}
        self.nbytes = sum(t.nbytes for t in self.copy.values())

    def adopt(self) -> None:
        """Move the weights into the pool's first slots, which `__init__` filled (off the
        worker's loop): run on the loop, where no forward reads them meanwhile; a
        weight changed since (its address or version) stays where it is, and the first
        commit that swaps it moves it in instead."""
        with torch.no_grad():
            for n, (ptr, version) in self.moving.items():
                p = self.params[n]
                if (p.data_ptr(), p._version) == (ptr, version):
                    p.data = self.pool.slots[0][n]
                    increment_version(p)
        self.moving = {}

    def close(self) -> None:
        """Give back the memory of a copy in a pool (its slots read as zeros after)."""
        if self.pool is not None:
            for t in self.copy.values():
                self.pool.punch(t)
            for n in self.moving:                    # never adopted (a failed join)
                self.pool.punch(self.pool.slots[0][n])
            self.moving = {}

    def written_rows(self, written: list[Announced]) -> dict[str, list[tuple[int, int]]]:
        """Each parameter the written tensors land in, with the row ranges they cover."""
        rows: dict[str, list[tuple[int, int]]] = {}
        for a in written:
            if a.where is not None:
                pname, start, n = a.where
                span = (0, self.params[pname].shape[0]) if n < 0 else (start, start + n)
                rows.setdefault(pname, []).append(span)
        return rows

    def target(self, a: Announced) -> torch.Tensor | None:
        """Where announced tensor `a` lands (a view in the parameter's layout), None if it
        is dropped."""
        if a.where is None:
            return None
        pname, start, rows = a.where
        full = self.copy[pname]
        return full if rows < 0 else full[start:start + rows]

    @torch.inference_mode()
    def commit(self, written: list[Announced]) -> int:
        """Make the written tensors the model's; returns the elements they hold."""
        rows: dict[str, int] = {}
        for a in written:
            if a.where is not None:
                pname, _, n = a.where
                rows[pname] = rows.get(pname, 0) + (n if n >= 0 else self.params[pname].shape[0])
        for pname, covered in rows.items():
            param, staged = self.params[pname], self.copy[pname]
            if covered == param.shape[0] and self.pool is not None \
                    and staged.device == param.device:     # (a CUDA model's gloo group: copied)
                # the pool's other slot: the weight's old memory if it was there
                half = self.pool.half_of(staged)
                param.data, self.copy[pname] = staged, self.pool.slots[1 - half][pname]
                increment_version(param)
            elif covered == param.shape[0] and staged.device == param.device:
                self.copy[pname], param.data = param.data, staged     # swap: no copy
                # its memory alternates between two places: what is cached by address
                # and version (packed copies, engines/cpu/linear.py) must not be taken
                # for the new values when it comes back to one
                increment_version(param)
            else:
                for a in written:
                    if a.where is not None and a.where[0] == pname:
                        _, start, n = a.where
                        sl = slice(None) if n < 0 else slice(start, start + n)
                        param[sl].copy_(staged[sl])
        return sum(math.prod(a.shape) for a in written if a.where is not None)
