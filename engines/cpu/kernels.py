"""The engine's CPU kernels, one small C++ library built from sources that share
`kernels.h`: `decode_attention.cpp`, `prefill_attention.cpp` and
`prefill_attention_bf16.cpp` (causal), `products.cpp` and
`panel_products.cpp` (matrix products and weight packings), `layer_ops.cpp`
(element-wise layer steps, argmax) and `experts.cpp` (a mixture's routed experts).

- `PagedDecode`: decode attention reading K and V in place from the pool. torch's path
  (engines/torch_backend.py) gathers each group's context into a dense copy and
  multiplies it; at batch 16 the copy and the products cost more than the model's
  attention is worth. One layer of SmolLM2 (3 KV heads of 64, 256 positions, 2
  threads; median of 7 alternating rounds): float32 1 row 62 -> 23 us, 16 rows
  760-2,170 -> 268 us; bfloat16 1 row 64 -> 22 us, 16 rows 421 -> 201 us; and about
  4x closer to float64 in bfloat16, since nothing is rounded before the output.
- products (engines/cpu/products.py): `SmallLinear`, 1-8 rows by row-major weights
  (float32, and bfloat16 where there is no AMX); `AmxLinear` and `PanelLinear`, by
  weights packed for the kernel (bfloat16 on AMX tiles, float32 in panels).
- `GroupedExperts` (engines/cpu/experts.py): a mixture's routed experts in one call per
  layer, tokens grouped by expert, only the chosen experts' weights read, by the
  small-batch products' blocks (small_products.h).
- `LayerOps` (engines/cpu/layer_ops.py): a layer's element-wise steps in one pass
  each, greedy argmax, and a prompt's causal attention (float32; bfloat16 on AMX,
  else by AVX512-BF16 dot products, else on float32 copies).

This module builds, caches and loads the library (`library`) and holds the decode
attention's side; the others look their entry points up in the loaded library.

The library is compiled on first use with the host's C++ compiler (`g++`, or $CXX)
for this CPU (-march=native), a few seconds, and kept in a cache directory keyed by
the sources, the flags, the compiler and the CPU, so workers after the first load it.
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
import time
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger("zpd.engine")

HEADERS = [Path(__file__).with_name(h) for h in ("kernels.h", "small_products.h")]  # what the sources share
SOURCES = [Path(__file__).with_name(f"{part}.cpp")
           for part in ("decode_attention", "prefill_attention", "prefill_attention_bf16", "products",
                        "panel_products", "layer_ops", "experts")]
COMPILE_FLAGS = ["-std=c++17", "-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC"]
LINK_FLAGS = ["-shared", "-fopenmp"]           # not -ffast-math: see kernels.h
LIBS = ["-lmvec", "-lm"]
BUILD_TIMEOUT_S = 120

C_INT64 = ctypes.c_int64
_ARGTYPES = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, C_INT64, ctypes.c_void_p,
             ctypes.c_void_p, C_INT64, C_INT64, C_INT64, C_INT64, C_INT64, ctypes.c_float,
             ctypes.c_void_p, ctypes.c_int]
_ERRORS = {-1: "bad shape", -2: "out of memory", -3: "a pool row out of range",
           -4: "this CPU, compiler or kernel lacks the instructions"}
UNSUPPORTED = -4
DTYPES = (torch.float32, torch.bfloat16)


@dataclass
class Settings:
    enabled: bool = True
    cache_dir: Path | None = None       # None: $XDG_CACHE_HOME/zpd/kernels or ~/.cache/zpd/kernels
    packed_weights: bool = True         # False: no packed weight copies (engines/cpu/linear.py)


SETTINGS = Settings()


_CACHES: list = []     # every kernel looked up once per process (`once`)


def once(fn):
    """functools.lru_cache, cleared by `configure`: a kernel (or None) looked up and
    checked once per process under the current settings."""
    cached = functools.lru_cache(maxsize=None)(fn)
    _CACHES.append(cached)
    return cached


def configure(enabled: bool = True, cache_dir: Path | None = None, packed_weights: bool = True) -> None:
    """Switch the kernels and the packed weight copies on or off and say where the
    kernels are built; runners (their CPU backends) made after this call follow it."""
    SETTINGS.enabled, SETTINGS.cache_dir, SETTINGS.packed_weights = enabled, cache_dir, packed_weights
    for cached in _CACHES:
        cached.cache_clear()


def describe(status: int) -> str:
    """What a kernel's nonzero status means."""
    return _ERRORS.get(status, str(status))


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
        objs, lib = [Path(tmp) / f"{src.stem}.o" for src in SOURCES], Path(tmp) / out.name
        compiles = [[compiler, *COMPILE_FLAGS, "-c", str(src), "-o", str(obj)] for src, obj in zip(SOURCES, objs)]
        _run_all(compiles)                                        # the sources side by side
        _run_all([[compiler, *LINK_FLAGS, *map(str, objs), "-o", str(lib), *LIBS]])
        os.replace(lib, out)


def _run_all(cmds: list[list[str]]) -> None:
    """Run `cmds` at once and wait for all; RuntimeError with the first failure's
    complaint (the others are killed), or if they take past BUILD_TIMEOUT_S."""
    deadline = time.monotonic() + BUILD_TIMEOUT_S
    procs = [subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for cmd in cmds]
    try:
        for cmd, proc in zip(cmds, procs):
            _, err = proc.communicate(timeout=max(0.0, deadline - time.monotonic()))
            if proc.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed: {err.strip()[-2000:]}")
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"{' '.join(e.cmd)} took over {BUILD_TIMEOUT_S} s") from None
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def build(directory: Path) -> Path:
    """The compiled library's path in `directory`, building it there if it is not
    there yet. Raises RuntimeError where there is no compiler or the build fails."""
    compiler = shutil.which(os.environ.get("CXX") or "g++")
    if compiler is None:
        raise RuntimeError(f"no C++ compiler ({os.environ.get('CXX') or 'g++'}) on PATH")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                             timeout=30).stdout
    key = hashlib.sha256("\0".join([*(f.read_text() for f in (*HEADERS, *SOURCES)),
                                    " ".join(COMPILE_FLAGS + LINK_FLAGS + LIBS),
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
            raise RuntimeError(f"decode attention kernel: {describe(status)}")
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


@once
def library() -> ctypes.CDLL | None:
    """The loaded library; None where it is switched off or cannot be built."""
    if not SETTINGS.enabled:
        log.info("the CPU kernels are switched off: torch's attention and products")
        return None
    try:
        return load()
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        log.warning("CPU kernels unavailable (%s); using torch's attention and products", e)
        return None


@once
def _kernel() -> PagedDecode | None:
    lib = library()
    try:
        return None if lib is None else PagedDecode(lib)
    except AttributeError as e:                      # a library without the entry points
        log.warning("CPU decode-attention kernel unavailable (%s); using torch's attention", e)
        return None


@once
def kernel_for(dtype: torch.dtype, device_type: str) -> PagedDecode | None:
    """The kernel for a pool of `dtype` on `device_type`, checked once; None: use
    torch's path (other dtypes and devices, or no working kernel)."""
    if device_type != "cpu" or dtype not in DTYPES:
        return None
    kernel = _kernel()
    return kernel if kernel is not None and _agrees(kernel, dtype) else None
