"""The control plane's overhead on idle processes, with and without busy-polling.

    python bench/bench_busy_poll.py [--settings 0,1000] [--requests 60] [--rounds 2]

Each setting of --busy-poll-us (the loops of the router and both workers poll without
sleeping for that long after each message) gets a 1P1D `zpd launch` cluster of the
embedded tiny model (compute is a fraction of a millisecond, so what a request waits
for is mostly the control plane). Per setting, pooled over --rounds (settings
alternate within a round):

- overhead: requests one at a time, back to back, 2 new tokens each (streamed);
  time to first token at the client minus the prefill's forward (its meta.timings),
  median and p90, in ms. It covers client -> router -> prefill and decode, the KV
  destination, the KV write, and the first token's way back.
- CPU per request: CPU seconds the three processes used during those requests / N.
- idle CPU: the share of one core the three took together over --idle-s seconds of
  no requests (heartbeats only, every 0.5 s per peer pair), i.e. the standing cost.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Launch, cpu_seconds, log_step, pct, random_prompts, wait_quiet  # noqa: E402

from zpd.client import Client  # noqa: E402


def cpu(cluster: Launch) -> float:
    return sum(cpu_seconds(pid) for pid in cluster.pids.values() if pid)


def overhead(router: str, prompts: list[list[int]]) -> list[float]:
    """TTFT - prefill forward of each request, one at a time (s)."""
    sampling = {"temperature": 0, "max_new_tokens": 2, "ignore_eos": True}
    out = []
    with Client(router, timeout=60) as client:
        for p in prompts:
            chunks = client.stream(input_ids=p, sampling_params=sampling)
            started = time.monotonic()
            next(chunks)
            ttft = time.monotonic() - started
            timings = list(chunks)[-1]["meta"]["timings"]
            out.append(ttft - timings["prefill_forward"] / 1e3)
    return out


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--settings", default="0,1000", help="--busy-poll-us values to compare")
    ap.add_argument("--requests", type=int, default=60, help="requests per setting per round")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--idle-s", type=float, default=5.0, help="seconds of idle CPU measured")
    ap.add_argument("--quiet-wait", type=float, default=20.0)
    args = ap.parse_args()
    args.settings = [float(s) for s in args.settings.split(",")]
    return args


def main() -> None:
    args = parse_args()
    prompts = random_prompts(args.requests + 2, args.prompt_len, 250, seed=0)
    over = {s: [] for s in args.settings}
    per_request = {s: [] for s in args.settings}
    idle = {s: [] for s in args.settings}
    with tempfile.TemporaryDirectory() as tmp:
        clusters: dict[float, Launch] = {}
        try:
            for s in args.settings:                                        # all start at once
                (Path(tmp) / str(s)).mkdir()
                clusters[s] = Launch(Path(tmp) / str(s), "tiny", ["--busy-poll-us", str(s)], wait=False)
            for cluster in clusters.values():
                cluster.wait_ready()
                overhead(cluster.router, prompts[:2])                       # warm up
            for r in range(args.rounds):
                for s, cluster in clusters.items():
                    wait_quiet(args.quiet_wait)
                    log_step(f"round {r + 1}: --busy-poll-us {s:g}")
                    before = cpu(cluster)
                    over[s] += overhead(cluster.router, prompts[2:])
                    per_request[s].append((cpu(cluster) - before) / args.requests)
                    before = cpu(cluster)
                    time.sleep(args.idle_s)
                    idle[s].append((cpu(cluster) - before) / args.idle_s)
        finally:
            for cluster in clusters.values():
                cluster.stop()
    print(f"\ntiny model, 1P1D, {args.requests} requests x {args.rounds} rounds per setting, one at "
          f"a time ({args.prompt_len}-token prompts); idle: {args.idle_s:g} s per round")
    print(f"{'--busy-poll-us':>15}{'overhead p50 ms':>17}{'p90 ms':>9}{'CPU ms/request':>16}"
          f"{'idle CPU %':>12}")
    for s in args.settings:
        print(f"{s:>15g}{pct(over[s], 50) * 1e3:>17.3f}{pct(over[s], 90) * 1e3:>9.3f}"
              f"{sum(per_request[s]) / len(per_request[s]) * 1e3:>16.3f}"
              f"{sum(idle[s]) / len(idle[s]) * 100:>12.2f}")


if __name__ == "__main__":
    main()
