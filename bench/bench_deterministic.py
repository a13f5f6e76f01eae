"""What --deterministic costs: the engine's default against its deterministic mode on
the same model, work, threads and machine, measured interleaved.

    python bench/bench_deterministic.py [--model smollm2] [--dtypes float32,bfloat16]
                                        [--threads 1] [--clock cpu|wall] [--rounds 3] [--smoke]

Work (bench_peer.py's): decode tok/s at batch 1 and 16 (prompts of --prompt-len random
ids, --new-tokens new tokens, greedy, ignore_eos), timed over the engine's decode steps
after the prefill's step; prefill tok/s of one --prefill-len prompt (one token
generated), timed over its step. zpd's OfflineEngine (the `zpd run` path), one per mode,
over one loaded model. Each round measures every cell in both modes back to back,
the mode that goes first alternating by round (this machine's speed drifts by tens of
percent within a minute), timed by this process's CPU seconds by default (--clock):
on a machine shared with other sessions the wall clock measured their load more than
ours. Printed per dtype and cell: both modes' median rate, the median of the
per-round time ratios (deterministic / default) and their range.

--smoke: the embedded tiny model, short lengths, one round: checks the script runs.
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import log_step, med  # noqa: E402  (also puts the repository on sys.path)

import torch  # noqa: E402

from engines.loader import load_model  # noqa: E402
from engines.offline import OfflineEngine  # noqa: E402
from engines.request import Request  # noqa: E402
from engines.sampler import SamplingParams  # noqa: E402


# cpu: this process's CPU seconds, which other sessions' load on a shared machine moves
# much less than the wall clock (at --threads 1; with more, OpenMP's waiting counts too)
CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}


class Side:
    """One mode's engine over the shared model."""

    def __init__(self, model, deterministic: bool) -> None:
        self.engine = OfflineEngine(model, kv_cache_mb=512, max_batch=64, deterministic=deterministic)

    def rate(self, prompts: list[list[int]], new: int, clock) -> tuple[float, int]:
        """(seconds of `clock`, tokens): with new == 1 the prefill of the prompts; else
        the decode steps after the first (which the prefill's step runs too)."""
        params = SamplingParams(max_new_tokens=new, temperature=0, ignore_eos=True)
        reqs = [Request(f"b{i}", list(p), params) for i, p in enumerate(prompts)]
        engine = self.engine
        for r in reqs:
            engine.submit(r)
        t = clock()
        engine.step()                              # admits and prefills them all
        if new == 1:
            return clock() - t, sum(map(len, prompts))
        before = sum(len(r.output) for r in reqs)
        t = clock()
        while engine.waiting or len(engine.batch):
            engine.step()
        return clock() - t, sum(len(r.output) for r in reqs) - before


def cells(args, vocab: int) -> dict[str, tuple[list[list[int]], int]]:
    rng = random.Random(0)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]
    out = {}
    for b in args.batch:
        out[f"decode b{b}"] = ([prompt(args.prompt_len) for _ in range(b)], b)
    out["prefill"] = ([prompt(args.prefill_len)], 1)
    return out


def measure(side: Side, name: str, prompts: list[list[int]], new: int, clock) -> tuple[float, int]:
    return side.rate(prompts, 1 if name == "prefill" else new, clock)


def run_dtype(args, dtype: str) -> None:
    model = load_model(args.model, dtype=dtype)
    sides = {"default": Side(model, False), "deterministic": Side(model, True)}
    work = cells(args, model.cfg.vocab_size)
    for name, (prompts, _) in work.items():           # warm up: packed copies, caches
        for side in sides.values():
            side.rate(prompts, 3, time.perf_counter)
    times: dict[tuple[str, str], list[float]] = {}
    tokens: dict[str, int] = {}
    for r in range(args.rounds):
        log_step(f"{dtype}: round {r + 1}/{args.rounds}")
        order = list(sides) if r % 2 == 0 else list(sides)[::-1]
        for name, (prompts, b) in work.items():
            for mode in order:
                seconds, tokens[name] = measure(sides[mode], name, prompts, args.new_tokens, CLOCKS[args.clock])
                times.setdefault((name, mode), []).append(seconds)
    print(f"\n{args.model} {dtype}, {torch.get_num_threads()} threads, {args.rounds} rounds, "
          f"{args.clock} seconds (tok/s: tokens per second of it)")
    print(f"{'cell':<12} {'default tok/s':>14} {'determ. tok/s':>14} {'time ratio':>11} {'range':>13}")
    for name in work:
        base, det = times[(name, "default")], times[(name, "deterministic")]
        ratios = sorted(d / s for d, s in zip(det, base))
        print(f"{name:<12} {tokens[name] / med(base):>14.1f} {tokens[name] / med(det):>14.1f} {med(ratios):>10.2f}x"
              f" {ratios[0]:>6.2f}-{ratios[-1]:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clock", choices=tuple(CLOCKS), default="cpu")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prefill-len", type=int, default=1024)
    ap.add_argument("--batch", default="1,16", help="decode batch sizes (default 1,16)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="tiny model, short lengths, one round")
    args = ap.parse_args()
    args.batch = [int(b) for b in args.batch.split(",")]
    if args.smoke:
        args.model, args.dtypes, args.rounds = "tiny", "float32", 1
        args.prompt_len, args.new_tokens, args.prefill_len, args.batch = 16, 4, 64, [1, 4]
    torch.set_num_threads(args.threads)
    for dtype in args.dtypes.split(","):
        run_dtype(args, dtype)


if __name__ == "__main__":
    main()
