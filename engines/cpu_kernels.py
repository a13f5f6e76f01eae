"""The engine's CPU kernels, in one small C++ library (`cpu_kernels.cpp`):

- `PagedDecode`: decode attention reading K and V in place from the pool. torch's path
  (`attention.decode_attention`) gathers each group's context into a dense copy and
  multiplies it; at batch 16 the copy and the products cost more than the model's
  attention is worth. One layer of SmolLM2 (3 KV heads of 64, 256 positions, 2
  threads; median of 7 alternating rounds): float32 1 row 62 -> 23 us, 16 rows
  760-2,170 -> 268 us; bfloat16 1 row 64 -> 22 us, 16 rows 421 -> 201 us; and about
  4x closer to float64 in bfloat16, since nothing is rounded before the output.
- `SmallLinear`: products of 1-8 rows by row-major weights (float32, and bfloat16
  where there is no AMX).
- `PackedLinear` (`AmxLinear`, `PanelLinear`): products by weights packed for the
  kernel, bfloat16 on AMX tiles and float32 in panels of 16 outputs.
- `LayerOps`: a layer's element-wise steps in one pass each, greedy argmax, and a
  float32 prompt's causal attention.

The library is compiled on first use with the host's C++ compiler (`g++`, or $CXX)
for this CPU (-march=native), about a second, and kept in a cache directory keyed by
the source, the flags, the compiler and the CPU, so workers after the first load it.
It is loaded with ctypes (no Python headers needed, and the call lets go of the GIL).
Before first use it is checked against a float64 reference once per process and
dtype. Without a compiler, with a build that fails or disagrees, or switched off
(`configure`; zpd's commands read ZPD_CPU_KERNELS and ZPD_KERNEL_CACHE for it, see
zpd/env.py), the engine stays on torch's ops, with a warning.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import stat
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger("zpd.engine")

SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
COMPILE_FLAGS = ["-std=c++17", "-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC"]
LINK_FLAGS = ["-shared", "-fopenmp"]           # not -ffast-math: see the source's header
LIBS = ["-lmvec", "-lm"]
BUILD_TIMEOUT_S = 120

_C_INT64 = ctypes.c_int64
_ARGTYPES = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, _C_INT64, ctypes.c_void_p,
             ctypes.c_void_p, _C_INT64, _C_INT64, _C_INT64, _C_INT64, _C_INT64, ctypes.c_float,
             ctypes.c_void_p, ctypes.c_int]
_ERRORS = {-1: "bad shape", -2: "out of memory", -3: "a pool row out of range",
           -4: "this CPU, compiler or kernel lacks the instructions"}
DTYPES = (torch.float32, torch.bfloat16)


@dataclass
class Settings:
    enabled: bool = True
    cache_dir: Path | None = None       # None: $XDG_CACHE_HOME/zpd/kernels or ~/.cache/zpd/kernels


SETTINGS = Settings()


def configure(enabled: bool = True, cache_dir: Path | None = None) -> None:
    """Switch the kernel on or off and say where it is built; runners made after this
    call follow it."""
    SETTINGS.enabled, SETTINGS.cache_dir = enabled, cache_dir
    for cached in (_library, _kernel, kernel_for, small_linear, packed_linear, layer_ops):
        cached.cache_clear()


def cache_dir() -> Path:
    if SETTINGS.cache_dir is not None:
        return SETTINGS.cache_dir
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "zpd" / "kernels"


def _cpu_identity() -> str:
    """What -march=native compiles for: the CPU's model and feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    wanted = [ln for ln in lines if ln.split(":")[0].strip() in ("model name", "flags")]
    return platform.machine() + "\n" + "\n".join(dict.fromkeys(wanted))


def _private(directory: Path) -> bool:
    """Whether `directory` is ours and nobody else can write to it (a library loaded
    from a directory others can write to would run their code)."""
    try:
        st = directory.stat()
    except OSError:
        return False
    return st.st_uid == os.getuid() and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def _compile(compiler: str, out: Path) -> None:
    """Build the library at `out` (atomically: concurrent builders each rename a
    whole file into place). Raises RuntimeError with the compiler's complaint."""
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".build-") as tmp:
        obj, lib = Path(tmp) / "cpu_kernels.o", Path(tmp) / out.name
        for cmd in ([compiler, *COMPILE_FLAGS, "-c", str(SOURCE), "-o", str(obj)],
                    [compiler, *LINK_FLAGS, str(obj), "-o", str(lib), *LIBS]):
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
            if done.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()[-2000:]}")
        os.replace(lib, out)


def build(directory: Path) -> Path:
    """The compiled library's path in `directory`, building it there if it is not
    there yet. Raises RuntimeError where there is no compiler or the build fails."""
    compiler = shutil.which(os.environ.get("CXX") or "g++")
    if compiler is None:
        raise RuntimeError(f"no C++ compiler ({os.environ.get('CXX') or 'g++'}) on PATH")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                             timeout=30).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), " ".join(COMPILE_FLAGS + LINK_FLAGS + LIBS),
                                    version, _cpu_identity()]).encode()).hexdigest()[:20]
    out = directory / f"cpu_kernels-{key}.so"
    if not out.exists():
        log.info("building the CPU kernels into %s", out)
        _compile(compiler, out)
    return out


def load() -> ctypes.CDLL:
    """The library, from the cache directory (built there once), or, where that cannot
    be made private to this user, built in a temporary directory that is removed once
    the library is loaded."""
    directory = cache_dir()
    try:
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError:
        pass
    if _private(directory):
        return ctypes.CDLL(str(build(directory)))
    log.warning("kernel cache %s is missing or writable by others; building in a "
                "temporary directory", directory)
    with tempfile.TemporaryDirectory(prefix="zpd-kernels-") as tmp:
        return ctypes.CDLL(str(build(Path(tmp))))      # stays mapped after its file goes


class PagedDecode:
    """The decode-attention entry points of the library, one per dtype."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        self.fns = {}
        for dtype in DTYPES:
            fn = getattr(self.lib, f"zpd_decode_attention_{str(dtype).removeprefix('torch.')}")
            fn.argtypes, fn.restype = _ARGTYPES, ctypes.c_int
            self.fns[dtype] = fn

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor,
                 lengths: torch.Tensor, scale: float) -> torch.Tensor:
        """q: [B, Hq, D]; k, v: pool rows [R, Hkv, D] (contiguous from their first row);
        rows: [B, W] int64 rows of k and v, sequence b reading its first lengths[b];
        -> [B, Hq, D]."""
        B, hq, d = q.shape
        assert q.is_contiguous() and rows.is_contiguous() and lengths.is_contiguous()
        assert rows.dtype == lengths.dtype == torch.int64 and k.dtype == v.dtype == q.dtype
        out = torch.empty_like(q)
        status = self.fns[q.dtype](q.data_ptr(), k.data_ptr(), v.data_ptr(), min(len(k), len(v)),
                                   rows.data_ptr(), lengths.data_ptr(), B, rows.shape[1], hq,
                                   k.shape[1], d, scale, out.data_ptr(), torch.get_num_threads())
        if status != 0:
            raise RuntimeError(f"decode attention kernel: {_ERRORS.get(status, status)}")
        return out


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor,
              lengths: torch.Tensor, scale: float) -> torch.Tensor:
    """The same attention in float64, one sequence at a time (for checks and tests)."""
    B, hq, d = q.shape
    group = hq // k.shape[1]
    out = torch.empty(B, hq, d, dtype=torch.float64)
    for b in range(B):
        r = rows[b, :int(lengths[b])]
        ks = k[r].double().repeat_interleave(group, dim=1)       # [n, Hq, D]
        vs = v[r].double().repeat_interleave(group, dim=1)
        w = torch.softmax(torch.einsum("hd,nhd->hn", q[b].double(), ks) * scale, dim=-1)
        out[b] = torch.einsum("hn,nhd->hd", w, vs)
    return out


def _agrees(kernel: PagedDecode, dtype: torch.dtype) -> bool:
    """Whether the kernel gives the float64 reference's attention for `dtype` on a
    small pool with uneven lengths (False, with a warning, if not)."""
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(64, 2, 32, generator=g).to(dtype) for _ in range(2))
    q = torch.randn(3, 6, 32, generator=g).to(dtype)
    rows = torch.randint(0, 64, (3, 40), generator=g)
    lengths = torch.tensor([40, 1, 17])
    got = kernel(q, k, v, rows, lengths, 0.2).double()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    if not torch.allclose(got, reference(q, k, v, rows, lengths, 0.2), rtol=tol, atol=tol):
        log.warning("the CPU decode-attention kernel disagrees with the reference in %s; "
                    "using torch's attention", dtype)
        return False
    return True


@functools.lru_cache(maxsize=None)
def _library() -> ctypes.CDLL | None:
    if not SETTINGS.enabled:
        log.info("the CPU kernels are switched off: torch's attention and products")
        return None
    try:
        return load()
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        log.warning("CPU kernels unavailable (%s); using torch's attention and products", e)
        return None


@functools.lru_cache(maxsize=None)
def _kernel() -> PagedDecode | None:
    lib = _library()
    try:
        return None if lib is None else PagedDecode(lib)
    except AttributeError as e:                      # a library without the entry points
        log.warning("CPU decode-attention kernel unavailable (%s); using torch's attention", e)
        return None


@functools.lru_cache(maxsize=None)
def kernel_for(dtype: torch.dtype, device_type: str) -> PagedDecode | None:
    """The kernel for a pool of `dtype` on `device_type`, checked once; None: use
    torch's path (other dtypes and devices, or no working kernel)."""
    if device_type != "cpu" or dtype not in DTYPES:
        return None
    kernel = _kernel()
    return kernel if kernel is not None and _agrees(kernel, dtype) else None


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
                            _C_INT64, _C_INT64, _C_INT64, ctypes.c_int]
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
            raise RuntimeError(f"{self.dtype} product kernel: {_ERRORS.get(status, status)}")
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


@functools.lru_cache(maxsize=None)
def small_linear(dtype: torch.dtype) -> SmallLinear | None:
    """The product kernel of 1-8 rows for `dtype` (float32, bfloat16), checked once;
    None: torch's products."""
    lib = _library() if dtype in DTYPES else None
    try:
        kernel = None if lib is None else SmallLinear(lib, dtype)
    except AttributeError as e:
        log.warning("%s product kernel unavailable (%s); using torch's products", dtype, e)
        return None
    return kernel if kernel is not None and _products_agree(kernel) else None


class PackedLinear:
    """y = x w^T (+ bias) from a copy of w packed for a kernel of the library (`pack`):
    the base of the AMX (bfloat16) and panel (float32) products."""

    DTYPE: torch.dtype
    SYMBOL: str
    PACK_SYMBOL: str
    BLOCK: int            # outputs per block of the packing (N is padded to it)

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.fn = getattr(lib, self.SYMBOL)
        self.fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                            _C_INT64, _C_INT64, _C_INT64, ctypes.c_int]
        self.fn.restype = ctypes.c_int
        self._pack = getattr(lib, self.PACK_SYMBOL)
        self._pack.argtypes = [ctypes.c_void_p, ctypes.c_void_p, _C_INT64, _C_INT64, ctypes.c_int]
        self._pack.restype = ctypes.c_int

    def pack(self, w: torch.Tensor) -> torch.Tensor:
        """`layout(w)`, by the library (in order, on torch's threads)."""
        assert self.fits(w)
        w = w.contiguous()
        n, k = w.shape
        out = w.new_empty(-(-n // self.BLOCK) * self.BLOCK * k)
        status = self._pack(w.data_ptr(), out.data_ptr(), n, k, torch.get_num_threads())
        if status != 0:
            raise RuntimeError(f"{type(self).__name__} packing: {_ERRORS.get(status, status)}")
        return out

    @classmethod
    def fits(cls, w: torch.Tensor) -> bool:
        return w.dtype == cls.DTYPE and w.dim() == 2 and w.shape[1] > 0

    @staticmethod
    def layout(w: torch.Tensor) -> torch.Tensor:
        """The packing of an [N, K] weight, in torch (the reference for `pack`)."""
        raise NotImplementedError

    def __call__(self, x: torch.Tensor, packed: torch.Tensor, n: int,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
        """x: [M, K]; packed: `pack` of an [n, K] weight; bias: [n] -> [M, n]."""
        k = x.shape[1]
        assert x.dtype == packed.dtype == self.DTYPE and x.dim() == 2 and self.fits(x)
        assert packed.is_contiguous() and packed.numel() == -(-n // self.BLOCK) * self.BLOCK * k
        assert bias is None or (bias.is_contiguous() and bias.dtype == x.dtype and bias.numel() == n)
        x = x.contiguous()
        y = torch.empty(x.shape[0], n, dtype=x.dtype)
        status = self.fn(x.data_ptr(), packed.data_ptr(), 0 if bias is None else bias.data_ptr(),
                         y.data_ptr(), x.shape[0], n, k, torch.get_num_threads())
        if status != 0:
            raise RuntimeError(f"{type(self).__name__} kernel: {_ERRORS.get(status, status)}")
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
    """float32 products of 9-64 rows (decode steps of larger batches) by AVX-512 FMAs
    from panels of 16 outputs, 16 rows at a time. SmolLM2's 121 products on 2 threads
    (median of 5 alternating rounds), against MKL's packed copies: 8 rows 38.2 -> 34.0
    ms, 16 rows 41.7 -> 31.8, 32 rows 67.5 -> 50.4."""

    DTYPE, SYMBOL, PACK_SYMBOL, BLOCK = torch.float32, "zpd_linear_panel_float32", "zpd_pack_panel_float32", 16

    @staticmethod
    def layout(w: torch.Tensor) -> torch.Tensor:
        """[N, K] -> [N' / 16, K, 16] with N' = N rounded up to 16 (zero rows): element
        [p, k, n] = w[16 p + n, k]."""
        n, k = w.shape
        padded = torch.nn.functional.pad(w, (0, 0, 0, -n % 16))
        return padded.reshape(-1, 16, k).transpose(1, 2).contiguous()


def _packed_agrees(kernel: PackedLinear) -> bool:
    """Whether a packed-weight kernel gives float64's products (to its dtype's
    rounding) for row counts in and across its blocks, outputs in and out of its
    blocks, with and without a bias, and leaves torch's own products (oneDNN's, on AMX
    tiles too in bfloat16) right when they run after it (False, with a warning where
    not; False where the CPU, compiler or OS kernel lacks what it needs)."""
    g, dt = torch.Generator().manual_seed(0), kernel.DTYPE
    tol = dict(rtol=1e-4, atol=1e-4) if dt == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    try:
        for n, k in ((40, 64), (13, 96), (64, 32)):
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


@functools.lru_cache(maxsize=None)
def packed_linear(dtype: torch.dtype) -> PackedLinear | None:
    """The packed-weight product kernel for `dtype` (bfloat16: AMX; float32: panels),
    checked once; None: not on this machine."""
    kinds = {torch.bfloat16: AmxLinear, torch.float32: PanelLinear}
    lib = _library() if dtype in kinds else None
    try:
        kernel = None if lib is None else kinds[dtype](lib)
    except AttributeError as e:
        log.warning("%s packed product kernel unavailable (%s); using torch's products", dtype, e)
        return None
    return kernel if kernel is not None and _packed_agrees(kernel) else None


class LayerOps:
    """A layer's element-wise steps for one dtype, each one call and one pass instead
    of 4-9 torch ops (at decode, torch's per-op cost is most of their time): RMSNorm,
    with the residual addition before it; SiLU(gate) * up; rotary embedding of queries
    and keys with the write of keys and values into the pool. Each rounds to the
    dtype where torch's ops do, so it gives torch's results to within float32
    reordering."""

    def __init__(self, lib: ctypes.CDLL, dtype: torch.dtype) -> None:
        name, p, i64 = str(dtype).removeprefix("torch."), ctypes.c_void_p, _C_INT64
        self.dtype = dtype
        self._norm = getattr(lib, f"zpd_rms_norm_{name}")
        self._norm.argtypes = [p, p, p, ctypes.c_float, p, p, i64, i64, ctypes.c_int]
        self._norm.restype = None
        self._silu = getattr(lib, f"zpd_silu_mul_{name}")
        self._silu.argtypes = [p, p, i64, i64, ctypes.c_int]
        self._silu.restype = None
        self._argmax = getattr(lib, f"zpd_argmax_{name}")
        self._argmax.argtypes = [p, i64, i64, p, ctypes.c_int]
        self._argmax.restype = None
        # float32 only: in bfloat16 torch's flash attention (bfloat16 products) is faster
        self._causal = getattr(lib, "zpd_causal_attention_float32") if dtype == torch.float32 else None
        if self._causal is not None:
            self._causal.argtypes = [p, p, p, i64, i64, i64, i64, i64, i64, ctypes.c_float, p, ctypes.c_int]
            self._causal.restype = ctypes.c_int
        self._rope = getattr(lib, f"zpd_rope_write_{name}")
        self._rope.argtypes = [p, p, p, p, i64, i64, i64, i64, i64, p, p, p, p, ctypes.c_int]
        self._rope.restype = ctypes.c_int

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x: [T, dim] -> weight * norm(x)."""
        assert x.dtype == weight.dtype == self.dtype and x.is_contiguous() and x.shape[-1] == weight.numel()
        out = torch.empty_like(x)
        self._norm(x.data_ptr(), None, weight.data_ptr(), eps, out.data_ptr(), None, x.shape[0],
                   x.shape[1], torch.get_num_threads())
        return out

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (weight * norm(x + residual), x + residual)."""
        assert x.dtype == residual.dtype == weight.dtype == self.dtype and x.shape == residual.shape
        assert x.is_contiguous() and residual.is_contiguous() and x.shape[-1] == weight.numel()
        out, total = torch.empty_like(x), torch.empty_like(x)
        self._norm(x.data_ptr(), residual.data_ptr(), weight.data_ptr(), eps, out.data_ptr(),
                   total.data_ptr(), x.shape[0], x.shape[1], torch.get_num_threads())
        return out, total

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[T, 2 I] (gate, then up) -> silu(gate) * up, [T, I]."""
        assert gate_up.dtype == self.dtype and gate_up.is_contiguous() and gate_up.shape[1] % 2 == 0
        out = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
        self._silu(gate_up.data_ptr(), out.data_ptr(), gate_up.shape[0], out.shape[1],
                   torch.get_num_threads())
        return out

    def causal_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         scale: float) -> torch.Tensor | None:
        """One prompt's causal attention to itself: q [n, Hq, D]; k, v [n, Hkv, D]
        (each position's heads contiguous) -> [n, Hq, D]; None where the kernel does not
        take it (bfloat16, head sizes other than 64 and 128, a CPU without AVX-512)."""
        if self._causal is None or q.shape[-1] not in (64, 128):
            return None
        n, hq, d = q.shape
        assert q.dtype == k.dtype == v.dtype == self.dtype and q.is_contiguous()
        assert k.shape == v.shape and k.shape[0] == n and k.shape[2] == d and hq % k.shape[1] == 0
        assert k.stride()[1:] == (d, 1) and v.stride()[1:] == (d, 1)
        out = torch.empty_like(q)
        status = self._causal(q.data_ptr(), k.data_ptr(), v.data_ptr(), k.stride(0), v.stride(0), n, hq,
                              k.shape[1], d, scale, out.data_ptr(), torch.get_num_threads())
        if status == -4:
            return None
        if status != 0:
            raise RuntimeError(f"causal attention kernel: {_ERRORS.get(status, status)}")
        return out

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """[B, V] -> [B] int64: torch.argmax(x, -1), a NaN counting as the maximum.
        torch's CPU argmax is a scalar loop: 0.84 ms for 16 x 49,152 float32 logits
        (2.3 ms in bfloat16), where this takes tens of microseconds."""
        assert x.dtype == self.dtype and x.dim() == 2 and x.is_contiguous() and x.shape[1] > 0
        out = torch.empty(x.shape[0], dtype=torch.int64)
        self._argmax(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr(), torch.get_num_threads())
        return out

    def rope_write(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   write_rows: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor,
                   q_heads: int, keys: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """qkv: [T, (Hq + 2 Hkv) D]; cos, sin: [T, 1, D]; write_rows: [T] rows of k_rows
        and v_rows ([R, Hkv, D], contiguous from their first row). Writes the rotated
        keys and the values there; -> rotated queries [T, Hq, D] (with `keys`, and the
        rotated keys [T, Hkv, D], for a prefill to attend to)."""
        t, (_, hkv, d) = qkv.shape[0], k_rows.shape
        assert qkv.dtype == cos.dtype == sin.dtype == k_rows.dtype == v_rows.dtype == self.dtype
        assert qkv.is_contiguous() and cos.is_contiguous() and sin.is_contiguous()
        assert qkv.shape[1] == (q_heads + 2 * hkv) * d and cos.shape == sin.shape == (t, 1, d)
        assert write_rows.dtype == torch.int64 and write_rows.is_contiguous() and write_rows.numel() == t
        q = qkv.new_empty(t, q_heads, d)
        k = qkv.new_empty(t, hkv, d) if keys else None
        status = self._rope(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), write_rows.data_ptr(),
                            min(len(k_rows), len(v_rows)), t, q_heads, hkv, d, q.data_ptr(),
                            k_rows.data_ptr(), v_rows.data_ptr(), None if k is None else k.data_ptr(),
                            torch.get_num_threads())
        if status != 0:
            raise RuntimeError(f"rotary kernel: {_ERRORS.get(status, status)}")
        return (q, k) if keys else q


def _torch_ops(dtype: torch.dtype):
    """torch's versions of LayerOps' steps (as engines/llama.py computes them)."""
    def norm(x, weight, eps):
        h = x.float()
        return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)

    def rope(x, cos, sin):
        return x * cos + x.roll(x.shape[-1] // 2, -1) * sin
    return norm, rope


def _layer_ops_agree(ops: LayerOps) -> bool:
    """Whether each step gives torch's result (to float32 reordering, then the dtype's
    rounding) on random inputs, rows on one thread and on several; False, with a
    warning, where not."""
    g, dt = torch.Generator().manual_seed(0), ops.dtype
    norm, rope = _torch_ops(dt)
    tol = dict(rtol=1e-5, atol=1e-5) if dt == torch.float32 else dict(rtol=2 ** -7, atol=1e-2)
    ok = True
    for rows in (3, 40):
        x, res = (torch.randn(rows, 72, generator=g).to(dt) for _ in range(2))
        w = torch.rand(72, generator=g).to(dt) + 0.5
        out, total = ops.add_rms_norm(x, res, w, 1e-5)
        ok &= torch.equal(total, x + res) and torch.allclose(out.float(), norm(x + res, w, 1e-5).float(), **tol)
        ok &= torch.allclose(ops.rms_norm(x, w, 1e-5).float(), norm(x, w, 1e-5).float(), **tol)
        gu = torch.randn(rows, 2 * 40, generator=g).to(dt)
        gate, up = gu.split(40, dim=-1)
        ok &= torch.allclose(ops.silu_mul(gu).float(), (torch.nn.functional.silu(gate) * up).float(), **tol)
        qkv = torch.randn(rows, (3 + 2 * 1) * 8, generator=g).to(dt)
        cos, sin = (torch.randn(rows, 1, 8, generator=g).to(dt) for _ in range(2))
        k_rows, v_rows = torch.zeros(rows + 5, 1, 8, dtype=dt), torch.zeros(rows + 5, 1, 8, dtype=dt)
        where = torch.randperm(rows + 5, generator=g)[:rows]
        q, k = ops.rope_write(qkv, cos, sin, where, k_rows, v_rows, 3, keys=True)
        qk = rope(qkv[:, :32].view(rows, 4, 8), cos, sin)
        ok &= torch.allclose(q.float(), qk[:, :3].float(), **tol) and torch.equal(k, k_rows[where])
        ok &= torch.allclose(k_rows[where].float(), qk[:, 3:].float(), **tol)
        ok &= torch.equal(v_rows[where], qkv[:, 32:].view(rows, 1, 8))
    for n, hq, hkv, d in ((70, 4, 2, 64), (130, 2, 1, 128)):
        q, k, v = (torch.randn(n, h, d, generator=g).to(dt) for h in (hq, hkv, hkv))
        got = ops.causal_attention(q, k, v, d ** -0.5)
        if got is not None:
            want = torch.nn.functional.scaled_dot_product_attention(
                *(t.transpose(0, 1)[None].double() for t in (q, k, v)), is_causal=True,
                scale=d ** -0.5, enable_gqa=True)[0].transpose(0, 1)
            ok &= torch.allclose(got.double(), want, rtol=1e-4, atol=1e-5)
    x = torch.randn(5, 1000, generator=g).to(dt)
    x[1, 7] = x[1, 900] = 10.0                     # ties: the first one
    x[2, 500] = float("nan")                       # a NaN is the maximum, as for torch
    x[3, 3] = x[3, 999] = float("nan")
    ok &= torch.equal(ops.argmax(x), x.argmax(-1)) and torch.equal(ops.argmax(x[:1]), x[:1].argmax(-1))
    if not ok:
        log.warning("the %s layer kernels disagree with torch's ops; using torch's", dt)
    return bool(ok)


@functools.lru_cache(maxsize=None)
def layer_ops(dtype: torch.dtype, device_type: str) -> LayerOps | None:
    """The element-wise layer kernels for `dtype` on `device_type`, checked once; None:
    torch's ops (other dtypes and devices, or no working library)."""
    lib = _library() if device_type == "cpu" and dtype in DTYPES else None
    try:
        ops = None if lib is None else LayerOps(lib, dtype)
    except AttributeError as e:
        log.warning("layer kernels unavailable (%s); using torch's ops", e)
        return None
    return ops if ops is not None and _layer_ops_agree(ops) else None
