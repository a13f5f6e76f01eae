"""What --clear-freed-pages costs: freeing a request's KV pages with and without zeroing.

    python bench/bench_clear.py [--repeats 9] [--tokens 512,2048] [--threads 2]

For each KV layout (the embedded `tiny` model in float32, and an 8B-class Llama layout:
32 layers, 8 KV heads, head dim 128, bfloat16, 2 MiB per page) and each request length,
a pool is allocated, a request's pages are filled, and `free_pages` is timed with and
without clearing (medians of --repeats). The clearing cost is paid once per request, on
the scheduler thread, when the request ends; the figures say how it compares with one
decode step of that request, which is what the user would notice.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import med  # noqa: E402
from engines.kv.layout import KVLayout  # noqa: E402
from engines.kv.pool import KVPool  # noqa: E402

LAYOUTS = {
    "tiny f32": KVLayout(num_layers=2, page_size=16, num_kv_heads=2, head_dim=16,
                         dtype="float32", element_bytes=4),
    "8B-class bf16": KVLayout(num_layers=32, page_size=16, num_kv_heads=8, head_dim=128,
                              dtype="bfloat16", element_bytes=2),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def time_free(layout: KVLayout, tokens: int, clear: bool, repeats: int) -> float:
    pages_needed = -(-tokens // layout.page_size)
    pool = KVPool(layout, pages_needed, DTYPES[layout.dtype], torch.device("cpu"), clear_on_free=clear)
    times = []
    for _ in range(repeats):
        pages = pool.allocator.alloc(pages_needed)
        pool.buffer[pages[0]:pages[-1] + 1].fill_(1)      # the request's KV
        start = time.perf_counter()
        pool.allocator.free_pages(pages)
        times.append(time.perf_counter() - start)
    return med(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--tokens", default="512,2048")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{'layout':<15} {'tokens':>6} {'MiB':>7} {'free ms':>8} {'free+clear ms':>13} "
          f"{'clear GB/s':>10}")
    for name, layout in LAYOUTS.items():
        for tokens in (int(t) for t in args.tokens.split(",")):
            plain = time_free(layout, tokens, False, args.repeats)
            cleared = time_free(layout, tokens, True, args.repeats)
            nbytes = -(-tokens // layout.page_size) * layout.page_bytes
            rate = nbytes / max(cleared - plain, 1e-9) / 1e9
            print(f"{name:<15} {tokens:>6} {nbytes / 2**20:>7.1f} {plain * 1e3:>8.3f} "
                  f"{cleared * 1e3:>13.3f} {rate:>10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
