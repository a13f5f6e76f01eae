"""Scheduler-loop benchmark.

1. Per-iteration cost of ``Loop.run_once`` with 10, 1,000 and 10,000 pending
   deadlines spread minutes ahead, while every iteration cancels and
   reschedules a few of them (what requests do as they change phase). Target:
   cost(10,000) / cost(10) <= 1.5, i.e. the loop does not scale with requests.
   run_once alone (no churn) is shown too: it is flat; what grows is the
   O(log n) heap push of each reschedule.
2. Deadline lateness (fire time - due time) for ~1,000 timers due over a few
   seconds while the loop also serves ping/pong traffic from a peer process
   and holds 10,000 far-future deadlines. Target: p99 <= 50 ms.

Run from the repository root: ``python bench/bench_loop.py [--quick]``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run without install

import zmq  # noqa: E402

from zpd.wire import protocol as p  # noqa: E402
from zpd.wire.loop import Loop, Timer  # noqa: E402
from zpd.wire.net import Dealer, Router  # noqa: E402


def _noop() -> None:
    pass


class _Churn:
    """A loop holding ``pending`` far-future deadlines and a bound socket;
    each step cancels and reschedules ``churn`` of them, then runs once."""

    def __init__(self, ctx: zmq.Context, pending: int, rng: random.Random) -> None:
        self.router = Router(ctx, "127.0.0.1", 0)
        self.loop = Loop()
        self.loop.add_socket(self.router, lambda: self.router.recv())
        self.rng = rng
        self.timers: list[Timer] = [self.loop.call_later(rng.uniform(60, 600), _noop)
                                    for _ in range(pending)]

    def seconds_per_iteration(self, iters: int, churn: int) -> float:
        loop, timers, rng = self.loop, self.timers, self.rng
        started = time.perf_counter()
        for _ in range(iters):
            for _ in range(churn):
                i = rng.randrange(len(timers))
                timers[i].cancel()
                timers[i] = loop.call_later(rng.uniform(60, 600), _noop)
            loop.run_once(max_wait=0)
        elapsed = (time.perf_counter() - started) / iters
        assert loop.pending_timers == len(timers)
        return elapsed

    def close(self) -> None:
        self.loop.close()
        self.router.close()


def iteration_costs(sizes: tuple[int, ...], iters: int, churn: int,
                    rounds: int = 7) -> dict[int, float]:
    """Median seconds per run_once for each size. Rounds interleave the sizes
    so background load on a shared machine hits all of them alike."""
    ctx = zmq.Context()
    rng = random.Random(0)
    benches = {n: _Churn(ctx, n, rng=rng) for n in sizes}
    samples: dict[int, list[float]] = {n: [] for n in sizes}
    try:
        for _ in range(rounds):
            for n, bench in benches.items():
                samples[n].append(bench.seconds_per_iteration(iters, churn))
        return {n: statistics.median(v) for n, v in samples.items()}
    finally:
        for bench in benches.values():
            bench.close()
        ctx.term()


def _peer(endpoint: str, rate: float, duration: float, counts: "mp.Queue[tuple[int, int]]") -> None:
    """Another process: send Pings at ``rate``/s in small bursts, read Pongs."""
    ctx = zmq.Context()
    dealer = Dealer(ctx, endpoint, identity=b"bench-peer")
    sent = received = 0
    burst = 20
    started = time.monotonic()
    while (now := time.monotonic()) - started < duration:
        due = int((now - started) * rate)
        while sent < due:
            for _ in range(min(burst, due - sent)):
                dealer.send(p.Ping(seq=sent, sent_at=time.monotonic(), sender="peer"))
                sent += 1
        while dealer.recv(timeout=0) is not None:
            received += 1
        time.sleep(burst / rate / 2)
    end = time.monotonic() + 1.0
    while received < sent and time.monotonic() < end:
        received += dealer.recv(timeout=0.05) is not None
    counts.put((sent, received))
    dealer.close()
    ctx.term()


def lateness(timers: int, spread: float, rate: float, background: int) -> dict[str, float]:
    """Lateness percentiles (seconds) of ``timers`` deadlines due over ``spread`` s."""
    ctx = zmq.Context()
    router = Router(ctx, "127.0.0.1", 0)
    loop = Loop()
    served = [0]

    def on_message() -> None:
        got = router.recv()
        if got is not None and isinstance(got[1], p.Ping):
            ping = got[1]
            router.send(got[0], p.Pong(seq=ping.seq, sent_at=ping.sent_at, sender="bench"))
            served[0] += 1

    loop.add_socket(router, on_message)
    rng = random.Random(1)
    for _ in range(background):
        loop.call_later(rng.uniform(600, 1200), _noop)
    late: list[float] = []

    def fired(due: float) -> None:
        late.append(loop.time() - due)
        if len(late) == timers:
            loop.stop()

    mpc = mp.get_context("spawn")
    counts: mp.Queue = mpc.Queue()
    peer = mpc.Process(target=_peer, args=(router.endpoint, rate, spread + 1.0, counts))
    peer.start()
    time.sleep(0.5)  # let the peer connect and start sending before timers are due
    start = loop.time() + 0.5
    for _ in range(timers):
        due = start + rng.uniform(0, spread)
        loop.call_at(due, fired, due)
    loop.run()
    while peer.is_alive():  # keep serving until the peer has its last pong
        loop.run_once(max_wait=0.05)
    peer.join()
    sent, received = counts.get(timeout=5)
    loop.close()
    router.close()
    ctx.term()
    late.sort()
    pick = lambda q: late[min(len(late) - 1, int(q * len(late)))]  # noqa: E731
    return {"p50": pick(0.50), "p99": pick(0.99), "max": late[-1], "served": served[0],
            "peer_sent": sent, "peer_received": received}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer iterations (smoke run)")
    args = ap.parse_args()
    iters = 2_000 if args.quick else 20_000
    print(f"run_once cost, {iters} iterations x 7 interleaved rounds (median), "
          "2 cancel+reschedule per iteration")
    sizes = (10, 1_000, 10_000)
    costs = iteration_costs(sizes, iters, churn=2)
    bare = iteration_costs(sizes, iters, churn=0)
    for pending in sizes:
        print(f"  {pending:>6} pending deadlines: {costs[pending] * 1e6:7.2f} us/iteration"
              f"  (run_once alone, no churn: {bare[pending] * 1e6:5.2f} us)")
    ratio = costs[10_000] / costs[10]
    print(f"  ratio 10,000/10: {ratio:.2f}  (target <= 1.5: {'PASS' if ratio <= 1.5 else 'FAIL'})")

    spread, rate = (1.0, 1_000.0) if args.quick else (3.0, 2_000.0)
    res = lateness(timers=1_000, spread=spread, rate=rate, background=10_000)
    print(f"deadline lateness, 1000 timers due over {spread:.0f} s, 10,000 more pending, "
          f"peer sending {rate:.0f} pings/s")
    print(f"  p50 {res['p50'] * 1e3:.3f} ms  p99 {res['p99'] * 1e3:.3f} ms  max {res['max'] * 1e3:.3f} ms"
          f"  (target p99 <= 50 ms: {'PASS' if res['p99'] <= 0.050 else 'FAIL'})")
    print(f"  pings served by the loop: {res['served']}  (peer sent {res['peer_sent']}, "
          f"got {res['peer_received']} pongs)")


if __name__ == "__main__":
    main()
