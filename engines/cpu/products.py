"""Matrix products of the CPU library (engines/cpu/products.cpp, the panels
panel_products.cpp), each checked against float64 once per process before
engines/cpu/linear.py uses it:

- `SmallLinear`: 1-8 rows by a row-major weight (decode at small batches), float32 on
  AVX-512 and bfloat16 on AVX512-BF16; no copy of the weight.
- `AmxLinear`, `PanelLinear` (`PackedLinear`): by a copy of the weight packed for the
  kernel, bfloat16 on AMX tiles and float32 in panels of 16 outputs.
"""
from __future__ import annotations

import ctypes
from abc import ABC, abstractmethod
import logging

import torch

from engines.cpu.kernels import C_INT64, DTYPES, describe, library, once

log = logging.getLogger("zpd.engine")



class SmallLinear:
    """y = x w^T (+ bias) for 1-8 rows x and a row-major weight w of one dtype (decode
    steps of small batches), each weight row read once for all rows: float32 by
    AVX-512 FMAs, bfloat16 by AVX512-BF16 dot products, both with float32 sums.
    SmolLM2's 121 products on 2 threads (median of 7 alternating rounds), bfloat16
    against oneDNN's packed copies: 1 row 25.1 -> 14.1 ms, 2 rows 25.1 -> 14.9, 4 rows
    25.4 -> 16.7, 8 rows 29.3 -> 24.0 (at 16 rows a first version took 41.5 against
    28.2, so more rows stay with oneDNN); float32: 1 row 21.9 ms column-major with
    F.linear -> 23.5 ms row-major here, 2 rows 24.4 (MKL-packed) -> 19.2, 4 rows
    28.0 -> 21.8."""

    ROWS = 8

    def __init__(self, lib: ctypes.CDLL, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.fn = getattr(lib, f"zpd_linear_{str(dtype).removeprefix('torch.')}")
        self.fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                            C_INT64, C_INT64, C_INT64, ctypes.c_int]
        self.fn.restype = ctypes.c_int

    def __call__(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x: [M <= 8, K]; w: [N, K] contiguous; bias: [N] -> [M, N]."""
        assert x.dtype == w.dtype == self.dtype and x.dim() == 2 and x.shape[1] == w.shape[1]
        assert 1 <= x.shape[0] <= self.ROWS and w.is_contiguous()
        assert bias is None or (bias.is_contiguous() and bias.dtype == w.dtype)
        x = x.contiguous()
        y = torch.empty(x.shape[0], w.shape[0], dtype=w.dtype)
        status = self.fn(x.data_ptr(), w.data_ptr(), 0 if bias is None else bias.data_ptr(), y.data_ptr(),
                         x.shape[0], w.shape[0], w.shape[1], torch.get_num_threads())
        if status != 0:
            raise RuntimeError(f"{self.dtype} product kernel: {describe(status)}")
        return y


def _products_agree(kernel: SmallLinear) -> bool:
    """Whether the product kernel gives float64's products (to its dtype's rounding)
    at 1 to 8 rows, with and without a bias, for lengths in and out of its vector
    steps and weight rows in and out of its blocks (False, with a warning where not;
    False where this CPU lacks the instructions)."""
    g = torch.Generator().manual_seed(0)
    tol = 1e-4 if kernel.dtype == torch.float32 else 2e-2
    try:
        for n, k in ((40, 64), (13, 70), (8, 5)):
            w = torch.randn(n, k, generator=g).to(kernel.dtype)
            b = torch.randn(n, generator=g).to(kernel.dtype)
            for rows in range(1, kernel.ROWS + 1):
                x = torch.randn(rows, k, generator=g).to(kernel.dtype)
                for bias in (None, b):
                    want = torch.nn.functional.linear(x.double(), w.double(),
                                                      None if bias is None else bias.double())
                    if not torch.allclose(kernel(x, w, bias).double(), want, rtol=tol, atol=tol):
                        log.warning("the %s product kernel disagrees with float64; using torch's "
                                    "products", kernel.dtype)
                        return False
    except RuntimeError as e:
        log.info("%s product kernel not used (%s)", kernel.dtype, e)
        return False
    return True


@once
def small_linear(dtype: torch.dtype) -> SmallLinear | None:
    """The product kernel of 1-8 rows for `dtype` (float32, bfloat16), checked once;
    None: torch's products."""
    lib = library() if dtype in DTYPES else None
    try:
        kernel = None if lib is None else SmallLinear(lib, dtype)
    except AttributeError as e:
        log.warning("%s product kernel unavailable (%s); using torch's products", dtype, e)
        return None
    return kernel if kernel is not None and _products_agree(kernel) else None


class PackedLinear(ABC):
    """y = x w^T (+ bias) from a copy of w packed for a kernel of the library (`pack`):
    the base of the AMX (bfloat16) and panel (float32) products."""

    DTYPE: torch.dtype
    SYMBOL: str
    PACK_SYMBOL: str
    BLOCK: int            # outputs per block of the packing (N is padded to it)
    ROWS: tuple[int, int]  # input rows it is used for (engines/cpu/linear.py)
    BEFORE_SMALL = False   # used ahead of the 1-8 row kernel for the rows it covers

    GATED_SYMBOL: str | None = None  # SiLU(gate) * up in the product (`gated`), where it has it

    def __init__(self, lib: ctypes.CDLL) -> None:
        args = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, C_INT64, C_INT64, C_INT64,
                ctypes.c_int]
        self.fn = getattr(lib, self.SYMBOL)
        self.gated_fn = getattr(lib, self.GATED_SYMBOL) if self.GATED_SYMBOL else None
        for f in (self.fn, self.gated_fn):
            if f is not None:
                f.argtypes, f.restype = args, ctypes.c_int
        self._pack = getattr(lib, self.PACK_SYMBOL)
        self._pack.argtypes = [ctypes.c_void_p, ctypes.c_void_p, C_INT64, C_INT64, ctypes.c_int]
        self._pack.restype = ctypes.c_int

    def pack(self, w: torch.Tensor) -> torch.Tensor:
        """`layout(w)`, by the library (in order, on torch's threads)."""
        assert self.fits(w)
        w = w.contiguous()
        n, k = w.shape
        out = w.new_empty(-(-n // self.BLOCK) * self.BLOCK * k)
        status = self._pack(w.data_ptr(), out.data_ptr(), n, k, torch.get_num_threads())
        if status != 0:
            raise RuntimeError(f"{type(self).__name__} packing: {describe(status)}")
        return out

    @classmethod
    def fits(cls, w: torch.Tensor) -> bool:
        return w.dtype == cls.DTYPE and w.dim() == 2 and w.shape[1] > 0

    @staticmethod
    @abstractmethod
    def layout(w: torch.Tensor) -> torch.Tensor:
        """The packing of an [N, K] weight, in torch (the reference for `pack`)."""

    def __call__(self, x: torch.Tensor, packed: torch.Tensor, n: int,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
        """x: [M, K]; packed: `pack` of an [n, K] weight; bias: [n] -> [M, n]."""
        return self._run(self.fn, x, packed, n, n, bias)

    def gated(self, x: torch.Tensor, packed: torch.Tensor, n: int,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        """SiLU(x w_gate^T) * (x w_up^T) of a packed [gate; up] weight of n rows (n / 2
        each, n a multiple of 64): [M, n / 2], rounded as `silu_mul` after the product
        would round it (engines/cpu/layer_ops.py), without writing the product."""
        assert self.gated_fn is not None and n % 64 == 0
        return self._run(self.gated_fn, x, packed, n, n // 2, bias)

    def _run(self, fn, x: torch.Tensor, packed: torch.Tensor, n: int, out: int,
             bias: torch.Tensor | None) -> torch.Tensor:
        k = x.shape[1]
        assert x.dtype == packed.dtype == self.DTYPE and x.dim() == 2 and self.fits(x)
        assert packed.is_contiguous() and packed.numel() == -(-n // self.BLOCK) * self.BLOCK * k
        assert bias is None or (bias.is_contiguous() and bias.dtype == x.dtype and bias.numel() == n)
        x = x.contiguous()
        y = torch.empty(x.shape[0], out, dtype=x.dtype)
        status = fn(x.data_ptr(), packed.data_ptr(), 0 if bias is None else bias.data_ptr(),
                    y.data_ptr(), x.shape[0], n, k, torch.get_num_threads())
        if status != 0:
            raise RuntimeError(f"{type(self).__name__} kernel: {describe(status)}")
        return y


class AmxLinear(PackedLinear):
    """bfloat16 products of any number of rows on AMX tiles. Threads share blocks of 32
    outputs, each streaming its packed weight once for up to 32 rows at a time.
    SmolLM2's 121 products on 2 threads (median of 7 alternating rounds), against
    oneDNN's packed copies (which run on AMX too here): 1 row 25.4 -> 13.9 ms, 4 rows
    24.7 -> 13.7, 8 rows 25.1 -> 14.4, 16 rows 28.8 -> 16.2, 32 rows 36.1 -> 20.6, 64
    rows 36.4 -> 34.3, 128 rows 60.1 -> 58.2, 256 rows 105.9 -> 108.9 (and the
    dot-product kernel above: 1 row 13.5, 4 rows 17.1, 8 rows 22.6). Needs K a
    multiple of 32 (`fits`)."""

    DTYPE, SYMBOL, PACK_SYMBOL, BLOCK = torch.bfloat16, "zpd_linear_amx_bfloat16", "zpd_pack_amx_bfloat16", 32
    ROWS, BEFORE_SMALL = (1, 256), True

    @classmethod
    def fits(cls, w: torch.Tensor) -> bool:
        return super().fits(w) and w.shape[1] % 32 == 0

    @staticmethod
    def layout(w: torch.Tensor) -> torch.Tensor:
        """[N, K] -> [N' / 32, K / 32, 2, 16, 16, 2] with N' = N rounded up to 32 (zero
        rows): element [b, s, h, r, n, j] = w[32 b + 16 h + n, 32 s + 2 r + j]."""
        n, k = w.shape
        padded = torch.nn.functional.pad(w, (0, 0, 0, -n % 32))
        return padded.reshape(-1, 2, 16, k // 32, 16, 2).permute(0, 3, 1, 4, 2, 5).contiguous()


class PanelLinear(PackedLinear):
    """float32 products of 9-64 rows (decode steps of larger batches; prefills too on
    CPUs not Intel's, engines/cpu/linear.py) by AVX-512 FMAs from panels of 16 outputs, up
    to 24 rows at a time (shared evenly: 25 -> 13 + 12; past 64 rows 3 panels by 8
    rows, engines/cpu/panel_products.cpp). SmolLM2's 121 products on 2
    threads of an Intel CPU (median of 5 alternating rounds), against MKL's
    packed copies: 8 rows 38.2 -> 34.0 ms, 16 rows 41.7 -> 31.8, 32 rows 67.5 -> 50.4
    (with 16-row blocks; engines/cpu/panel_products.cpp has what 24 changed)."""

    DTYPE, SYMBOL, PACK_SYMBOL, BLOCK = torch.float32, "zpd_linear_panel_float32", "zpd_pack_panel_float32", 16
    GATED_SYMBOL = "zpd_linear_panel_gated_float32"
    ROWS = (9, 64)                                # more on CPUs not Intel's: engines/cpu/linear.py

    @staticmethod
    def layout(w: torch.Tensor) -> torch.Tensor:
        """[N, K] -> [N' / 16, K, 16] with N' = N rounded up to 16 (zero rows): element
        [p, k, n] = w[16 p + n, k]."""
        n, k = w.shape
        padded = torch.nn.functional.pad(w, (0, 0, 0, -n % 16))
        return padded.reshape(-1, 16, k).transpose(1, 2).contiguous()


class BPanelLinear(PackedLinear):
    """bfloat16 products of 9 rows and more where the CPU has AVX512-BF16 but no AMX, by dot
    products of input pairs (float32 sums) from panels of 16 outputs, in the passes of
    `PanelLinear`. SmolLM2's 121 products on 2 threads of an AMD EPYC
    (alternating, median ms), against oneDNN's packed copies: 9 rows 20.3 -> 14.4, 16
    rows 23.6 -> 17.1, 24 rows 30.2 -> 21.6, 32 rows 34.8 -> 28.9, 64 rows 62.2 -> 58.4,
    even at 128 and 256; a batch-16 decode step of SmolLM2 39.9 -> 26.1 ms. Past 256
    rows against the plain weights (F.linear, oneDNN's), SmolLM2's 4 products of a layer
    at 256 / 512 / 1,024 rows: 5.07 / 9.60 / 18.21 -> 4.73 / 9.06 / 17.98 ms, and with
    SiLU(gate) * up in the product the MLP's gate and up 9.64 -> 8.87 ms at 1,024."""

    DTYPE, SYMBOL, PACK_SYMBOL, BLOCK = torch.bfloat16, "zpd_linear_bpanel_bfloat16", "zpd_pack_bpanel_bfloat16", 16
    GATED_SYMBOL = "zpd_linear_bpanel_gated_bfloat16"
    ROWS = (9, 1 << 40)

    @classmethod
    def fits(cls, w: torch.Tensor) -> bool:
        return super().fits(w) and w.shape[1] % 2 == 0

    @staticmethod
    def layout(w: torch.Tensor) -> torch.Tensor:
        """[N, K] -> [N' / 16, K / 2, 16, 2] with N' = N rounded up to 16 (zero rows):
        element [p, s, n, j] = w[16 p + n, 2 s + j]."""
        n, k = w.shape
        padded = torch.nn.functional.pad(w, (0, 0, 0, -n % 16))
        return padded.reshape(-1, 16, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def _packed_agrees(kernel: PackedLinear) -> bool:
    """Whether a packed-weight kernel gives float64's products (to its dtype's
    rounding) for row counts in and across its blocks, outputs in and out of its
    blocks, with and without a bias, and leaves torch's own products (oneDNN's, on AMX
    tiles too in bfloat16) right when they run after it (False, with a warning where
    not; False where the CPU, compiler or OS kernel lacks what it needs)."""
    g, dt = torch.Generator().manual_seed(0), kernel.DTYPE
    tol = dict(rtol=1e-4, atol=1e-4) if dt == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    try:
        for n, k in ((40, 64), (13, 96), (64, 32), (24, 64)):
            w = torch.randn(n, k, generator=g).to(dt)
            b = torch.randn(n, generator=g).to(dt)
            packed = kernel.pack(w)
            if not torch.equal(packed, kernel.layout(w).view(-1)):
                log.warning("the %s packing is not its layout; using torch's %s products",
                            type(kernel).__name__, dt)
                return False
            for rows in (1, 5, 16, 17, 32, 33, 70):
                x = torch.randn(rows, k, generator=g).to(dt)
                for bias in (None, b):
                    want = torch.nn.functional.linear(x.double(), w.double(),
                                                      None if bias is None else bias.double())
                    got = kernel(x, packed, n, bias).double()
                    after = torch.nn.functional.linear(x, w, bias).double()
                    if not (torch.allclose(got, want, **tol) and torch.allclose(after, want, **tol)):
                        log.warning("the %s product kernel disagrees with float64; using torch's "
                                    "%s products", type(kernel).__name__, dt)
                        return False
    except RuntimeError as e:
        log.info("%s product kernel not used (%s)", type(kernel).__name__, e)
        return False
    return True


def gated_reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """SiLU(x w_gate^T) * (x w_up^T) in float64, w = [gate; up]."""
    y = torch.nn.functional.linear(x.double(), w.double(), None if bias is None else bias.double())
    gate, up = y.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def _gated_agrees(kernel: PackedLinear) -> bool:
    """Whether the kernel's SiLU(gate) * up in the product gives float64's (to its
    dtype's rounding), in passes of every row count up to and past its blocks (False,
    with a warning, where not or where the library lacks it)."""
    g, dt = torch.Generator().manual_seed(1), kernel.DTYPE
    tol = dict(rtol=1e-4, atol=1e-4) if dt == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    try:
        for n, k in ((64, 32), (192, 96)):
            w, b = torch.randn(n, k, generator=g).to(dt), torch.randn(n, generator=g).to(dt)
            packed = kernel.pack(w)
            for rows in (1, 5, 6, 7, 13, 70):
                x = torch.randn(rows, k, generator=g).to(dt)
                for bias in (None, b):
                    if not torch.allclose(kernel.gated(x, packed, n, bias).double(), gated_reference(x, w, bias), **tol):
                        log.warning("the %s kernel's SiLU(gate) * up disagrees with float64; the "
                                    "product and silu_mul stay apart", type(kernel).__name__)
                        return False
    except RuntimeError as e:
        log.info("%s kernel's SiLU(gate) * up not used (%s)", type(kernel).__name__, e)
        return False
    return True


@once
def packed_linear(dtype: torch.dtype) -> PackedLinear | None:
    """The packed-weight product kernel for `dtype` (bfloat16: AMX, else AVX512-BF16
    panels; float32: panels), the first that passes its check; None: not on this
    machine."""
    kinds = {torch.bfloat16: (AmxLinear, BPanelLinear), torch.float32: (PanelLinear,)}
    lib = library() if dtype in kinds else None
    for kind in kinds[dtype] if lib is not None else ():
        try:
            kernel = kind(lib)
        except AttributeError as e:
            log.warning("%s packed product kernel unavailable (%s)", kind.__name__, e)
            continue
        if _packed_agrees(kernel):
            if kernel.gated_fn is not None and not _gated_agrees(kernel):
                kernel.gated_fn = None
            return kernel
    return None


@once
def row_invariant_linear(dtype: torch.dtype) -> PackedLinear | None:
    """The panel kernel of `dtype` (float32: `PanelLinear`, bfloat16: `BPanelLinear`,
    even where AMX runs the default's bfloat16 products), checked once: each output one
    FMA chain over K in order, whatever the number of rows and threads, so --deterministic
    uses it at every size (engines/cpu/deterministic.py). None: not on this machine."""
    kind = {torch.float32: PanelLinear, torch.bfloat16: BPanelLinear}.get(dtype)
    lib = library() if kind is not None else None
    if lib is None:
        return None
    try:
        kernel = kind(lib)
    except AttributeError as e:
        log.warning("%s packed product kernel unavailable (%s)", kind.__name__, e)
        return None
    kernel.gated_fn = None                # SiLU(gate) * up stays apart, as in decode steps
    return kernel if _packed_agrees(kernel) else None
