"""Allocator settings for a long-running process: glibc malloc's for one that runs
the model on the CPU (`tune_allocator`), and Python's collector (`freeze_startup_objects`).

A decode step allocates and frees the same large temporaries every step (the KV
gathered for attention: tens of MB at batch 64). glibc serves blocks above its mmap
threshold with fresh mmap()s, returned on free(), so each step page-faults its
temporaries in again, and it trims freed heap memory back to the kernel too. A fixed
32 MB threshold (glibc's largest; it also stops the threshold from moving) and a
1 GB trim threshold keep those blocks in the heap for reuse: a decode step of 64
sequences of 576 tokens on the prefix-cache benchmark's model took 108-120 ms
instead of 191-215 ms. The price is that up to 1 GB of freed memory stays with the
process instead of going back to the kernel.

Python's cyclic collector, once in a while, scans every object the process holds.
After `import torch` that is ~166,000 objects and a full collection takes ~80-90 ms
here: a decode step that triggers one stalls every stream that long (one such pause
in ~1,900 steps of 64 sequences on `tiny`). What start-up made (imports, the model,
the tokenizer) lives as long as the process, so it is frozen out of the collector's
sight once the process is ready; collections then scan only what requests made.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging

log = logging.getLogger("engines.allocator_tuning")

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3           # glibc's mallopt() parameters
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 1 << 30


def tune_allocator() -> bool:
    """Apply the settings above to this process; False (and nothing changed) where the
    C library is not glibc."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        log.info("no glibc mallopt here: allocator left as it is")
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def freeze_startup_objects() -> int:
    """Collect once, then move every object this process holds out of the collector's
    reach (gc.freeze); returns how many were frozen. Call when start-up is done."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.debug("froze %d start-up objects out of the collector's scans", frozen)
    return frozen
