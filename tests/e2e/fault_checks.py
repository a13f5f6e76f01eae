"""What every fault test checks, shared by tests/e2e/test_faults*.py: exact outputs
(float64 greedy from `zpd run`'s engine), endings within a bound, pages back, and the
servers serving again."""
from __future__ import annotations

import functools
import random

from engines.loader import load_model
from engines.sampler import SamplingParams
from tests.e2e.fault_cluster import FaultCluster, Proc, Requests
from zpd.client import Client
from engines.offline import OfflineEngine
from engines.request import Request

DETECT = 2.0 + 0.5       # peer timeout + one heartbeat: a dead peer is noticed by then
SLACK = 2.0              # a loaded 2-core machine: scheduling, polling, process wake-ups


@functools.lru_cache(maxsize=None)
def _model(dtype: str = "float64"):
    return load_model("tiny", dtype=dtype)


def reference(work: list[tuple[list[int], int]], dtype: str = "float64") -> list[list[int]]:
    engine = OfflineEngine(_model(dtype))
    reqs = [Request(f"r{i}", ids, SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True))
            for i, (ids, n) in enumerate(work)]
    return [o["output_ids"] for o in engine.run(reqs)]


def prompts(n: int, seed: int, max_new: tuple[int, int] = (3, 10)) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(256) for _ in range(rng.randint(3, 60))], rng.randint(*max_new))
            for _ in range(n)]


def status(out: dict) -> int | None:
    return out["finish_reason"].get("status_code")


def check_correct(outs: dict[str, dict], work: dict[str, tuple[list[int], int]]) -> None:
    refs = dict(zip(work, reference(list(work.values()))))
    for rid, out in outs.items():
        assert out["finish_reason"]["type"] == "length", (rid, out["finish_reason"])
        assert out["output_ids"] == refs[rid], rid


def serves_correctly(cluster: FaultCluster, n: int = 6, seed: int = 99, free: bool = True) -> None:
    """New requests after the fault: exact outputs, then every page free again."""
    work = {f"after{seed}-{i}": w for i, w in enumerate(prompts(n, seed))}
    with cluster.client() as c:
        outs = c.generate_many([{"input_ids": ids, "rid": rid, "sampling_params": {
            "temperature": 0, "max_new_tokens": m, "ignore_eos": True}}
            for rid, (ids, m) in work.items()])
    check_correct({o["rid"]: o for o in outs}, work)
    if free:
        cluster.wait_all_free(timeout=5)


def queue_total(cluster: FaultCluster, workers: list[Proc], queue: str) -> int:
    return sum(cluster.worker_status(w)["queues"][queue] for w in workers if w.alive)


def router_sees(cluster: FaultCluster, worker: Proc, alive: bool) -> bool:
    with cluster.client(timeout=10) as c:
        replies = c.admin("status", timeout=5)["workers"]
    return any(r["endpoint"] == worker.endpoint and r["ok"] == alive for r in replies)


def submit(cluster_client: Client, work: dict[str, tuple[list[int], int]],
           stream: bool = False) -> Requests:
    """The work submitted and being read; `with submit(c, work) as reqs` inside `c`'s own
    `with` stops the reader before `c` closes, however the test ends."""
    reqs = Requests(cluster_client)
    for rid, (ids, n) in work.items():
        reqs.submit(rid, ids, n, stream)
    return reqs.start()


def ended_within(reqs: Requests, rids: list[str], since: float, bound: float) -> None:
    for rid in rids:
        took = reqs.ended_at[rid] - since
        assert took <= bound, f"{rid} ended {took:.2f} s after the fault (bound {bound} s)"



def warm_up(cluster: FaultCluster) -> None:
    """Let every prefill write to every decode once before any test freezes one.

    Mooncake opens its session to a peer inside the first write's submit, on the
    transport's one helper thread; if that peer is frozen the submit blocks until it
    thaws, and every other transfer of that prefill waits behind it (a transport
    limitation, reported; see the closing note of issue 4). The router breaks load
    ties at random, so each of 20 request pairs covers a given prefill/decode pair
    with probability 1/2: all four are covered but for a one-in-a-million chance."""
    with cluster.client() as c:
        outs = c.generate_many([{"input_ids": [i + 1, 2], "sampling_params": {"max_new_tokens": 1}}
                                for i in range(40)])
    assert all(o["finish_reason"]["type"] in ("length", "stop") for o in outs), \
        [o["finish_reason"] for o in outs]

