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
3. Wake-up cost vs idle sockets: the loop watches one ROUTER that a peer thread
   pings (one Ping, wait for the Pong: every message is a wake-up from sleep)
   plus 1, 9, 81 or 256 idle DEALERs connected over TCP (a router's links to
   workers), once with zmq.Poller (``Loop(waiter="poll")``, the old loop) and
   once with epoll, interleaved. CPU seconds of the loop's thread per wake-up
   (CLOCK_THREAD_CPUTIME_ID: the kernel's per-thread account, as
   /proc/self/task/TID/stat has it, at ns resolution); the handler's own work (recv,
   decode, a Pong) is in every figure alike.

Run from the repository root: ``python bench/bench_loop.py [--quick] [--only wakeup]``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import random
import statistics
import sys
import threading
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


PACE = 200e-6     # seconds between one Pong and the next Ping


def _pinger(endpoint: str, ctx: zmq.Context, go: threading.Event, done: threading.Event,
            count: list[int], stop: threading.Event) -> None:
    """A peer thread: per round, ``count[0]`` Ping/Pong exchanges, one at a time."""
    dealer = Dealer(ctx, endpoint, identity=b"pinger")
    try:
        while True:
            go.wait()
            go.clear()
            if stop.is_set():
                return
            for seq in range(count[0]):
                dealer.send(p.Ping(seq=seq, sent_at=0.0, sender="bench"))
                if dealer.recv(timeout=5.0) is None:
                    raise RuntimeError("the loop did not answer a ping within 5 s")
                time.sleep(PACE)     # the loop goes back to sleep before the next one
            done.set()
    finally:
        dealer.close()


def wakeup_costs(idle_counts: tuple[int, ...], exchanges: int, rounds: int) -> dict:
    """(waiter, idle) -> (median CPU s per wake-up of the loop's thread, [per round],
    median wall s per exchange, iterations per exchange that answered nothing)."""
    ctx = zmq.Context()
    sink = Router(ctx, "127.0.0.1", 0)          # what the idle DEALERs are connected to
    idle = [Dealer(ctx, sink.endpoint, identity=f"idle{i}".encode()) for i in range(max(idle_counts))]
    front = Router(ctx, "inproc://bench-wakeup", 0)
    go, done, stop, count = threading.Event(), threading.Event(), threading.Event(), [exchanges]
    peer = threading.Thread(target=_pinger, args=(front.endpoint, ctx, go, done, count, stop))
    peer.start()
    cpu: dict[tuple[str, int], list[float]] = {}
    wall: dict[tuple[str, int], list[float]] = {}
    answered = [0]
    slept: dict[tuple[str, int], list[int]] = {}

    def on_front() -> None:
        got = front.recv()
        if got is not None:
            front.send(got[0], p.Pong(seq=got[1].seq, sent_at=0.0, sender="bench"))
            answered[0] += 1

    try:
        for _ in range(rounds):
            for n in idle_counts:
                for waiter in ("poll", "epoll"):
                    loop = Loop(waiter=waiter, max_poll=0.5)
                    loop.add_socket(front, on_front)
                    for d in idle[:n]:
                        loop.add_socket(d, d.recv)
                    loop.run_once(max_wait=0)
                    answered[0] = 0
                    done.clear()
                    c0, w0 = time.thread_time(), time.perf_counter()
                    go.set()
                    sleeps = 0
                    while not done.is_set() or answered[0] < exchanges:
                        before = answered[0]
                        loop.run_once()
                        sleeps += answered[0] == before
                    slept.setdefault((waiter, n), []).append(sleeps)
                    c1, w1 = time.thread_time(), time.perf_counter()
                    cpu.setdefault((waiter, n), []).append((c1 - c0) / exchanges)
                    wall.setdefault((waiter, n), []).append((w1 - w0) / exchanges)
                    for d in idle[:n]:
                        loop.remove_socket(d)
                    loop.remove_socket(front)
                    loop.close()
    finally:
        stop.set()
        go.set()
        peer.join()
        for s in (*idle, front, sink):
            s.close()
        ctx.term()
    return {k: (statistics.median(v), v, statistics.median(wall[k]),
                sum(slept[k]) / (exchanges * rounds)) for k, v in cpu.items()}


def report_wakeups(quick: bool) -> None:
    exchanges, rounds = (40, 1) if quick else (3_000, 7)
    idle_counts = (1, 9, 81, 256)
    costs = wakeup_costs(idle_counts, exchanges, rounds)
    print(f"wake-up cost: {exchanges} ping/pong exchanges x {rounds} interleaved rounds (median); "
          "CPU us of the loop's thread per wake-up (spread of the rounds), wall us per exchange")
    for n in idle_counts:
        old, new = costs[("poll", n)], costs[("epoll", n)]
        spread = lambda v: f"{min(v) * 1e6:.1f}-{max(v) * 1e6:.1f}"  # noqa: E731
        print(f"  {n:>4} idle sockets: zmq.Poller {old[0] * 1e6:6.1f} us ({spread(old[1])})"
              f"   epoll {new[0] * 1e6:6.1f} us ({spread(new[1])})"
              f"   wall {old[2] * 1e6:6.1f} / {new[2] * 1e6:6.1f} us"
              f"   idle turns {old[3]:.2f} / {new[3]:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer iterations (smoke run)")
    ap.add_argument("--only", choices=("wakeup",), help="run only the wake-up comparison (3.)")
    args = ap.parse_args()
    if args.only == "wakeup":
        report_wakeups(args.quick)
        return
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
    report_wakeups(args.quick)


if __name__ == "__main__":
    main()
