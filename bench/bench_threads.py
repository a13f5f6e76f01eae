"""`zpd launch`'s default thread split vs torch's default (every worker on all cores).

    python bench/bench_threads.py [--model tiny] [--sizes 64,256,1024,4096] [--repeats 2]

Load, as issue #16 measured it: one client submits N requests at once (32-token
prompts, 16 new tokens, greedy, ignore_eos) to a 1P1D cluster and waits for all;
per-request cost = wall time / N. Each size runs --repeats times back to back on the
same cluster, so a cost that grows from one run to the next (the slowdown seen with
torch's default threads) shows in the table. A burst in which requests end early (with
torch's threads the workers can starve the router of CPU until it declares one
unavailable) shows as "failed", with the reason, and the run goes on.

Configurations (one cluster each, alternating per size so a burst of other work on
the machine hits both):
  split   `zpd launch` defaults: the cores divided among the workers, each bound to
          its own (on 2 cores: one thread each, prefill on CPU 0, decode on CPU 1)
  torch   `--threads <all cores> --no-cpu-bind`: what every worker got before

The router limits one client to --max-client-requests (1,024 by default); the
clusters here raise it to the largest size. Figures: per-request ms for every
(size, repeat), and per configuration the spread max/min of those costs (1.0 =
flat across sizes and repeats).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Launch, log_step, random_prompts, wait_quiet  # noqa: E402

from zpd.client import Client  # noqa: E402

PROMPT_LEN, NEW_TOKENS = 32, 16


def configurations(largest: int) -> dict[str, list[str]]:
    limits = ["--max-client-requests", str(largest), "--kv-cache-mb", "512",
              "--max-batch", "256"]
    cores = len(os.sched_getaffinity(0))
    return {"split": limits, "torch": limits + ["--threads", str(cores), "--no-cpu-bind"]}


class BurstFailed(RuntimeError):
    """Some requests of a burst ended early (e.g. a worker declared unavailable)."""


def burst(router: str, prompts: list[list[int]]) -> float:
    """Seconds for all prompts submitted at once to finish (BurstFailed if any ended
    early)."""
    sampling = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
    with Client(router, timeout=600) as c:
        started = time.perf_counter()
        out = c.generate_many([{"input_ids": p, "sampling_params": sampling} for p in prompts])
        took = time.perf_counter() - started
    bad = [o for o in out if len(o["output_ids"]) != NEW_TOKENS]
    if bad:
        raise BurstFailed(f"{len(bad)} requests ended early: {bad[0]['finish_reason']}")
    return took


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--sizes", default="64,256,1024,4096", help="requests per burst")
    ap.add_argument("--repeats", type=int, default=2, help="bursts of each size, back to back")
    ap.add_argument("--quiet-wait", type=float, default=30.0,
                    help="seconds to wait for the machine to go idle before each burst")
    args = ap.parse_args()
    args.sizes = [int(n) for n in args.sizes.split(",")]
    return args


def main() -> None:
    args = parse_args()
    configs = configurations(max(args.sizes))
    prompts = random_prompts(max(args.sizes), PROMPT_LEN, 250, seed=0)     # within every vocabulary
    cost: dict[str, dict[tuple[int, int], float | None]] = {name: {} for name in configs}
    failures: list[str] = []          # a configuration that fails is reported, not fatal
    with tempfile.TemporaryDirectory() as tmp:
        clusters = {}
        try:
            for name, flags in configs.items():                          # all start at once
                (Path(tmp) / name).mkdir()
                clusters[name] = Launch(Path(tmp) / name, args.model, flags, wait=False)
            for name, cluster in clusters.items():
                cluster.wait_ready()
                log_step(f"{name}: {cluster.shown}")
                burst(cluster.router, prompts[:8])                        # warm up
            for n in args.sizes:
                for r in range(args.repeats):
                    for name, cluster in clusters.items():
                        wait_quiet(args.quiet_wait)
                        try:
                            cost[name][n, r] = burst(cluster.router, prompts[:n]) / n * 1e3
                        except BurstFailed as e:
                            cost[name][n, r] = None
                            failures.append(f"{name}: {n} requests, run {r + 1}: {e}")
                            log_step(failures[-1])
                            continue
                        log_step(f"{name}: {n} requests, run {r + 1}: {cost[name][n, r]:.3f} ms each")
        finally:
            for cluster in clusters.values():
                cluster.stop()
    print(f"\nper-request ms, {args.model} model, 1P1D, one client submitting N requests at once "
          f"({PROMPT_LEN}-token prompts, {NEW_TOKENS} new tokens), {len(os.sched_getaffinity(0))} cores")
    print(f"{'N':>6} {'run':>4}" + "".join(f"{name:>10}" for name in configs))
    for n in args.sizes:
        for r in range(args.repeats):
            print(f"{n:>6} {r + 1:>4}" + "".join(f"{'failed':>10}" if cost[name][n, r] is None
                                                  else f"{cost[name][n, r]:>10.3f}" for name in configs))
    for name in configs:
        values = [c for c in cost[name].values() if c is not None]
        if values:
            print(f"{name}: spread max/min {max(values) / min(values):.2f}, total "
                  f"{sum(n * c for (n, _), c in cost[name].items() if c is not None) / 1e3:.1f} s"
                  f"{'' if len(values) == len(cost[name]) else ' (failed bursts left out)'}")
    for failure in failures:
        print("failed:", failure)


if __name__ == "__main__":
    main()
