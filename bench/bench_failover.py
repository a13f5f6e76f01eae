"""Failover benchmark: time from killing (kill -9) or freezing (SIGSTOP) a peer to
the last affected request's 503 at the client, with default settings (heartbeat
0.5 s, peer timeout 2 s). Target: <= 3 s.

- decode: requests are decoding (streaming tokens) on the victim decode; the router
  notices the silence and answers them 503.
- prefill: requests are in transfer from the victim prefill (its writes are held in
  the transport by ZPD_TRANSPORT_FAULT=delay, so they are mid-transfer when it
  dies); the decode notices the silence and answers them 503.

Each sample restarts (or thaws) the victim and waits until the router uses it again.
Run from the repository root: ``python bench/bench_failover.py [--repeats N]``.
"""
from __future__ import annotations

import argparse
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run without install

from tests.e2e.fault_cluster import FaultCluster, Proc, Requests, wait_for  # noqa: E402
from zpd.env import FAULT_ENV  # noqa: E402

PER_VICTIM = 4      # affected requests per sample


def router_alive(cluster: FaultCluster, worker: Proc) -> bool:
    with cluster.client(timeout=10) as c:
        workers = c.admin("status", timeout=5)["workers"]
    return any(w["endpoint"] == worker.endpoint and w["ok"] for w in workers)


def one_sample(cluster: FaultCluster, victim: Proc, how: str, stream: bool, state: str) -> float:
    """Seconds from the kill/freeze to the last 503 of a request on the victim."""
    n = 2 * PER_VICTIM                      # least-loaded routing: half land on the victim
    with cluster.client() as c:
        reqs = Requests(c)
        for i in range(n):
            reqs.submit(f"{how}{time.monotonic_ns()}-{i}", [1 + i, 2, 3], 4000, stream=stream)
        reqs.start()
        wait_for(lambda: _in_state(cluster, reqs, state, n), timeout=60, what=state)
        t = time.monotonic()
        victim.kill() if how == "kill" else victim.signal(signal.SIGSTOP)
        wait_for(lambda: _lost(reqs, victim) >= PER_VICTIM, timeout=30, what="the 503s")
        took = max(reqs.ended_at[rid] for rid, o in list(reqs.done.items())
                   if victim.endpoint in o["finish_reason"].get("message", "")) - t
        with cluster.client() as admin:             # end the others
            for rid in reqs.chunks:
                admin.admin("abort", rid=rid)
        reqs.wait(60)
    victim.restart() if how == "kill" else victim.signal(signal.SIGCONT)
    wait_for(lambda: router_alive(cluster, victim), timeout=30, what="the victim back")
    cluster.wait_all_free(timeout=60)
    return took


def _in_state(cluster: FaultCluster, reqs: Requests, state: str, n: int) -> bool:
    if state == "running":
        return all(reqs.tokens(rid) >= 1 for rid in reqs.chunks)
    return sum(cluster.worker_status(p)["queues"]["writing"] for p in cluster.prefills) == n


def _lost(reqs: Requests, victim: Proc) -> int:
    with reqs.lock:
        return sum(o["finish_reason"].get("status_code") == 503 for o in reqs.done.values())


def run(role: str, how: str, repeats: int, tmp: Path) -> list[float]:
    if role == "decode":
        cluster = FaultCluster(tmp / f"{role}-{how}", prefill=1, decode=2, dtype="float32",
                               flags=("--kv-cache-mb", "16"))
        victim, stream, state = cluster.decodes[0], True, "running"
    else:
        cluster = FaultCluster(tmp / f"{role}-{how}", prefill=2, decode=1, dtype="float32",
                               flags=("--kv-cache-mb", "16"),
                               prefill_env={FAULT_ENV: "delay:seconds=15"})
        victim, stream, state = cluster.prefills[0], False, "writing"
    try:
        return [one_sample(cluster, victim, how, stream, state) for _ in range(repeats)]
    finally:
        cluster.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    print(f"time from losing a peer to the last affected request's 503 (default settings: "
          f"heartbeat 0.5 s, peer timeout 2 s), {args.repeats} samples x {PER_VICTIM} requests")
    with tempfile.TemporaryDirectory(prefix="zpd-failover-") as tmp:
        for role in ("decode", "prefill"):
            for how in ("kill", "stop"):
                (Path(tmp) / f"{role}-{how}").mkdir()
                samples = run(role, how, args.repeats, Path(tmp))
                what = "kill -9" if how == "kill" else "SIGSTOP"
                worst = max(samples)
                print(f"  {what:7} {role:7}: median {statistics.median(samples):.2f} s, "
                      f"max {worst:.2f} s  [{', '.join(f'{s:.2f}' for s in samples)}]"
                      f"  (target <= 3 s: {'PASS' if worst <= 3.0 else 'FAIL'})", flush=True)


if __name__ == "__main__":
    main()
