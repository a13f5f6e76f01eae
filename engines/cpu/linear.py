"""The model's matrix products, multiplying by packed copies of the weights on CPU.

`F.linear` on CPU hands its weight to the BLAS as it is, in every call. Both of
torch's CPU backends can keep a weight in their own blocked layout instead:
oneDNN for bfloat16 (the layout torch's compiler uses for frozen CPU graphs), MKL's
packed GEMM for float32. Over SmolLM2's 121 products on two threads here
(alternating rounds, median ms):

    bfloat16, plain -> oneDNN-packed: 1 row 30.9 -> 24.4, 16 rows 33.3 -> 25.4,
        64 rows 52.1 -> 33.7, 256 rows 102 -> 92, but 1,024 rows 588 -> 652
    float32, column-major (below) -> MKL-packed: 1 row 24.0 -> 27.3, 2 rows 33.0 -> 29.2,
        8 rows 57.3 -> 39.0, 16 rows 67.0 -> 47.6, but 24 rows 65.4 -> 70.8

so each dtype uses its packed copy for the input sizes of its `rows` (decode steps,
short prompts) and the plain weight otherwise. A packed copy is derived from its
parameter and rebuilt when the parameter changes (a weight update copies into it, a
trainer push swaps its storage), so every writer of weights stays as it is. The cost
is memory: a second copy of each projection and the head, made on first use;
`PackedWeights(enabled=False)` (the CPU backend's, where engines.cpu.kernels.configure
says so; zpd's commands: ZPD_PACKED_WEIGHTS=0) goes without them.

Where the CPU has them, engines/cpu/products.py's kernels come first: bfloat16
weights are packed for its AMX kernel (1-256 rows; SmolLM2's products against
oneDNN's packed copies at 16 rows 28.8 -> 16.2 ms, 32 rows 36.1 -> 20.6, even from
128 rows on), or without AMX in panels for its AVX512-BF16 kernel (from 9 rows; 16
rows 23.6 -> 17.1 ms against oneDNN's on an AMD EPYC), float32 weights in panels for its AVX-512 kernel (9-64 rows, every
size from 9 on a CPU not Intel's: `_panel_max_rows`; 16 rows 41.7 -> 31.8 ms
against MKL's), and float32 products of 1-8 rows (bfloat16 too
without AMX) go to its small-batch kernel, which needs no copy. Past 64 rows the
panel kernels also give the MLP's SiLU(gate) * up in the product (`gated_linear`).

Each packing is checked once per process before it is used (the library's against
float64, torch's against `F.linear`), and one whose ops are missing or disagree is
not used (with a warning). Other dtypes and devices always call `F.linear`. Without
the float32 kernels, float32 weights are held column-major
(LlamaForCausalLM.column_major_float32), faster with F.linear at 1 row and past 16.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from engines.cpu import products as cpu_products

log = logging.getLogger("zpd.engine")

PACK_BATCH_HINT = 16          # the batch both libraries pick their blocking for
GATED_MIN_ROWS = 64           # fewer rows (decode steps): the product, then silu_mul


@dataclass(frozen=True)
class Packing:
    """How one dtype's weights are packed and multiplied by."""
    name: str
    rows: tuple[int, int]                                      # input rows that use it
    pack: Callable[[torch.Tensor], torch.Tensor]
    mul: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
    fits: Callable[[torch.Tensor], bool] = lambda w: True      # weights it can pack
    before_small: bool = False     # used ahead of the 1-8 row kernel for rows it covers
    gated: Callable | None = None  # SiLU(gate) * up in the product: `PackedWeights.gated_linear`


PACKINGS = {
    torch.bfloat16: Packing(
        "oneDNN", (1, 256),
        lambda w: torch.ops.mkldnn._reorder_linear_weight(w, PACK_BATCH_HINT),
        lambda x, p, w, b: torch.ops.mkldnn._linear_pointwise(x, p, b, "none", [], "")),
    # MKL's packed B does not depend on the batch it was packed for; the op runs the
    # packed GEMM when told the input's own batch (and checks it against F.linear below)
    torch.float32: Packing(
        "MKL", (2, 16),
        lambda w: torch.ops.mkl._mkl_reorder_linear_weight(w, PACK_BATCH_HINT),
        lambda x, p, w, b: torch.ops.mkl._mkl_linear(x, p, w, b, x.shape[0])),
}


def _kernel_packing(dtype: torch.dtype) -> Packing | None:
    """Weights packed for engines/cpu/products.py's packed-weight kernel of `dtype`,
    where it runs: bfloat16 on AMX for 1-256 rows (ahead of the 1-8 row kernel), else
    in AVX512-BF16 panels from 9 rows; float32 in panels from 9 rows (to
    `_panel_max_rows`)."""
    kernel = cpu_products.packed_linear(dtype)
    if kernel is None:
        return None
    lo, hi = kernel.ROWS
    rows = (lo, max(hi, _panel_max_rows())) if dtype == torch.float32 else (lo, hi)
    gated = None if kernel.gated_fn is None else lambda x, p, w, b: kernel.gated(x, p, w.shape[0], b)
    return Packing(type(kernel).__name__, rows, kernel.pack, lambda x, p, w, b: kernel(x, p, w.shape[0], b),
                   fits=kernel.fits, before_small=kernel.BEFORE_SMALL, gated=gated)


def _panel_max_rows() -> int:
    """The most rows of a float32 product the panel kernel takes: its own 64 where the
    CPU is Intel's, none fewer elsewhere. Past 64 rows F.linear runs MKL's GEMM, as fast as
    anything here on Intel (~200 GFLOP/s on two threads at 1,024 rows) but not on
    other CPUs, where MKL takes a generic path: on an AMD EPYC (Zen 4, two threads),
    SmolLM2's seven products of a layer at 128 / 256 / 1,024 rows took 6.0 / 11.1-11.8
    / 38.3-48.7 ms by F.linear against 4.8 / 9.7-10.4 / 36.1-40.5 ms by the panels."""
    try:
        intel = "GenuineIntel" in Path("/proc/cpuinfo").read_text()
    except OSError:
        intel = True
    return 64 if intel else 1 << 40


def _candidates(dtype: torch.dtype) -> list[Packing]:
    """The packings to try for `dtype`, best first."""
    library = PACKINGS.get(dtype) if torch.backends.mkldnn.is_available() else None
    return [p for p in (_kernel_packing(dtype), library) if p is not None]


def _agrees(packing: Packing, dtype: torch.dtype) -> bool:
    """Whether `packing` gives F.linear's products on this machine's torch, at the
    ends and middle of its rows, with and without a bias (False, with a warning, if
    not or if its ops are missing)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(40, 64, generator=g).to(dtype).t().contiguous().t()   # column-major too
    b = torch.randn(40, generator=g).to(dtype)
    lo, hi = packing.rows[0], min(packing.rows[1], 256)
    try:
        p = packing.pack(w)
        for n in sorted({lo, (lo + hi) // 2, hi}):
            x = torch.randn(n, 64, generator=g).to(dtype)
            for bias in (None, b):
                want = F.linear(x.double(), w.double(), None if bias is None else bias.double())
                if not torch.allclose(packing.mul(x, p, w, bias).double(), want, rtol=0.02, atol=0.05):
                    log.warning("%s packing of %s weights disagrees with F.linear; using F.linear",
                                packing.name, dtype)
                    return False
    except (AttributeError, RuntimeError) as e:
        log.warning("%s packing of %s weights unavailable (%s); using F.linear", packing.name, dtype, e)
        return False
    return True


class PackedWeights:
    """Packed copies of CPU weights, each held on its parameter with the storage and
    in-place version it was packed from and the packing that made it, so a stale copy
    (or one in another packing's layout) is never used."""

    ATTR = "_zpd_packed"

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._usable: dict[torch.dtype, Packing | None] = {}

    def usable(self, dtype: torch.dtype) -> Packing | None:
        """The packing of `dtype`, checked on first call; None: plain products."""
        if dtype not in self._usable:
            self._usable[dtype] = None
            if not self.enabled and dtype in PACKINGS:
                log.info("packed weights are switched off: %s products use the plain weights", dtype)
            else:
                self._usable[dtype] = next((p for p in _candidates(dtype) if _agrees(p, dtype)), None)
        return self._usable[dtype]

    def linear(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if w.device.type != "cpu" or x.dim() != 2:
            return F.linear(x, w, bias)
        rows, packing = x.shape[0], self.usable(w.dtype)
        if packing is not None and not (packing.rows[0] <= rows <= packing.rows[1] and packing.fits(w)):
            packing = None
        if (packing is None or not packing.before_small) and 1 <= rows <= cpu_products.SmallLinear.ROWS \
                and w.is_contiguous():
            kernel = cpu_products.small_linear(w.dtype)
            if kernel is not None:
                return kernel(x, w, bias)
        copy = None if packing is None else self._copy(w, packing)
        return F.linear(x, w, bias) if copy is None else packing.mul(x, copy, w, bias)

    def gated_linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor | None:
        """SiLU(x w_gate^T) * (x w_up^T) for w = [gate; up] in one pass of the panel
        kernel, which reads x as it is past GATED_MIN_ROWS rows (prefills), where it
        takes w: the product is not written, nor read again by a `silu_mul`. None
        otherwise (the caller multiplies, then applies its silu_mul)."""
        if w.device.type != "cpu" or x.dim() != 2 or x.shape[0] <= GATED_MIN_ROWS or w.shape[0] % 64:
            return None
        packing = self.usable(w.dtype)
        if packing is None or packing.gated is None or not packing.fits(w) \
                or not packing.rows[0] <= x.shape[0] <= packing.rows[1]:
            return None
        copy = self._copy(w, packing)
        return None if copy is None else packing.gated(x, copy, w, None)

    def _copy(self, w: torch.Tensor, packing: Packing) -> torch.Tensor | None:
        """w's packed copy (made now if it has none of its current values)."""
        try:
            key = (w.data_ptr(), w._version, packing.name)
        except RuntimeError:                   # an inference tensor counts no versions
            return None
        got = getattr(w, self.ATTR, None)
        if got is None or got[0] != key:
            got = (key, packing.pack(w.detach()))
            setattr(w, self.ATTR, got)
        return got[1]

    def packed(self, w: torch.Tensor) -> bool:
        """Whether `w` holds a packed copy of its current values."""
        got = getattr(w, self.ATTR, None)
        return got is not None and got[0][:2] == (w.data_ptr(), w._version)
