"""Decode attention per layer: torch's path (gather the context, then multiply) vs the
compiled kernel that reads the pool in place (engines/cpu/kernels.py), side by side.

    python bench/bench_attention.py [--batches 1,4,16,64] [--contexts 256,1024]
                                    [--dtypes float32,bfloat16] [--rounds 5] [--smoke]

SmolLM2-135M's shapes (30 layers, 9 query heads over 3 KV heads of 64) on a pool
of 16-token pages, each sequence's pages in allocation order. A round calls each side
once per layer, for all 30 layers, after writing over a buffer larger than the
pool's layers (as a step's weights do), so K and V come from memory, not cache, as
they do in a decode step. Microseconds per layer call, the median of --rounds
alternating rounds, and the largest difference of each side from float64.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import med  # noqa: E402  (also puts the repository on sys.path)

from engines.kv.paged import PagedKV  # noqa: E402
from engines.torch_backend import DecodeGroup, _attend  # noqa: E402
from engines.cpu.kernels import kernel_for, reference  # noqa: E402

PAGE = 16


def case(dtype: torch.dtype, batch: int, context: int, layers: int, kv_heads: int, group: int,
         head_dim: int) -> dict:
    pages_each = -(-context // PAGE)
    pool = PagedKV(torch.randn(batch * pages_each + 1, layers, 2, PAGE, kv_heads, head_dim).to(dtype))
    table = torch.arange(batch * pages_each).view(batch, pages_each)
    steps = torch.arange(context)
    rows = (table[:, steps // PAGE] * layers * 2 * PAGE + steps % PAGE).contiguous()    # [B, S]
    index = rows[:, None, :] * kv_heads + torch.arange(kv_heads)[None, :, None]
    return {"pool": pool, "rows": rows, "lengths": torch.full((batch,), context),
            "group": DecodeGroup(None, index, None),
            "q": torch.randn(batch, kv_heads * group, head_dim).to(dtype), "scale": head_dim ** -0.5}


def sides(c: dict) -> dict:
    kernel = kernel_for(c["q"].dtype, "cpu")
    out = {"torch": lambda layer: _attend(c["q"], c["pool"], layer, c["group"], c["scale"])}
    if kernel is not None:
        out["kernel"] = lambda layer: kernel(c["q"], *c["pool"].layer_rows(layer), c["rows"],
                                             c["lengths"], c["scale"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,4,16,64")
    ap.add_argument("--contexts", default="256,1024")
    ap.add_argument("--max-pool-gb", type=float, default=2.0, help="skip cases whose pool is larger")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--evict-mb", type=int, default=600, help="buffer written over between rounds")
    ap.add_argument("--smoke", action="store_true", help="tiny settings: checks the script runs")
    args = ap.parse_args()
    layers, kv_heads, group, head_dim = 30, 3, 3, 64
    if args.smoke:
        args.batches, args.contexts, args.rounds, args.evict_mb, layers = "1,4", "40", 1, 8, 2
    torch.set_num_threads(args.threads)
    evict = torch.zeros(args.evict_mb << 18)
    print(f"decode attention, us per layer call ({layers} layers, {kv_heads * group} query heads over "
          f"{kv_heads} KV heads of {head_dim}, {args.threads} threads, caches cold; "
          f"median of {args.rounds} alternating rounds)")
    print(f"{'dtype':10} {'batch':>6} {'context':>8} {'torch':>9} {'kernel':>9} {'ratio':>7}   max |err| torch / kernel")
    for dtype in [getattr(torch, d) for d in args.dtypes.split(",")]:
        for context in [int(x) for x in args.contexts.split(",")]:
            for batch in [int(x) for x in args.batches.split(",")]:
                gb = batch * -(-context // PAGE) * layers * 2 * PAGE * kv_heads * head_dim \
                    * torch.empty((), dtype=dtype).element_size() / 1e9
                if gb > args.max_pool_gb:
                    print(f"{str(dtype)[6:]:10} {batch:6d} {context:8d}   skipped: a {gb:.1f} GB pool "
                          f"(--max-pool-gb {args.max_pool_gb:g})")
                    continue
                c = case(dtype, batch, context, layers, kv_heads, group, head_dim)
                fns, times = sides(c), {}
                for f in fns.values():
                    f(0)                                           # first calls set things up
                for r in range(args.rounds):
                    order = list(fns) if r % 2 == 0 else list(fns)[::-1]
                    for name in order:
                        evict.add_(1)
                        t = time.perf_counter()
                        for layer in range(layers):
                            fns[name](layer)
                        times.setdefault(name, []).append((time.perf_counter() - t) / layers * 1e6)
                want = reference(c["q"], *c["pool"].layer_rows(1), c["rows"], c["lengths"], c["scale"])
                err = {n: (f(1).double() - want).abs().max().item() for n, f in fns.items()}
                us = {n: med(t) for n, t in times.items()}
                if "kernel" in us:
                    k, ratio = f"{us['kernel']:.1f}", f"{us['torch'] / us['kernel']:.2f}x"
                    kerr = f"{err['kernel']:.1e}"
                else:
                    k = ratio = kerr = "-"
                print(f"{str(dtype)[6:]:10} {batch:6d} {context:8d} {us['torch']:9.1f} {k:>9} {ratio:>7}"
                      f"   {err['torch']:.1e} / {kerr}", flush=True)
    print("ratio: torch's time / the kernel's (above 1: the kernel is faster)")


if __name__ == "__main__":
    main()
