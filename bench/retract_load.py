"""bench_retract.py's load: a Stream submits requests on its own Client from its own
thread and stamps every chunk's arrival; helpers to build requests, end them all and
wait until the cluster is idle."""
from __future__ import annotations

import random
import threading
import time
from bisect import bisect_right
from dataclasses import dataclass, field

from zpd.client import Client
@dataclass
class Stream:
    """Submits `reqs` (rid, input_ids, sampling) on its own Client from its own thread, then
    receives; every chunk's arrival is stamped. The thread owns the socket throughout."""
    router: str
    reqs: list[tuple[str, list[int], dict]]
    timeout: float = 300.0
    times: dict[str, list[float]] = field(default_factory=dict)     # arrival of each chunk
    counts: dict[str, list[int]] = field(default_factory=dict)      # tokens so far, per chunk
    output: dict[str, list[int]] = field(default_factory=dict)
    finish: dict[str, dict] = field(default_factory=dict)
    last_chunk: float = 0.0
    submitted_at: float = 0.0
    error: str = ""

    def __post_init__(self) -> None:
        for rid, _, _ in self.reqs:
            self.times[rid], self.counts[rid], self.output[rid] = [], [], []
        self.lock, self.stopping = threading.Lock(), False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            with Client(self.router, timeout=self.timeout) as client:
                self.submitted_at = time.monotonic()
                for rid, ids, sampling in self.reqs:
                    client.submit(input_ids=ids, rid=rid, stream=True, sampling_params=sampling)
                while len(self.finish) < len(self.reqs) and not self.stopping:
                    try:
                        chunk = client.receive(timeout=0.5)
                    except TimeoutError:
                        continue
                    now = time.monotonic()
                    rid = chunk["rid"]
                    with self.lock:
                        self.output[rid] += chunk["token_ids"]
                        self.times[rid].append(now)
                        self.counts[rid].append(len(self.output[rid]))
                        self.last_chunk = now
                        if chunk["finished"]:
                            self.finish[rid] = chunk["finish_reason"]
        except Exception as e:           # reported by the main thread's waits
            self.error = repr(e)

    def min_tokens(self) -> int:
        with self.lock:
            return min(len(o) for o in self.output.values())

    def tokens(self) -> dict[str, int]:
        with self.lock:
            return {rid: len(o) for rid, o in self.output.items()}

    def wait_until(self, cond, what: str, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            if self.error:
                raise RuntimeError(f"client thread failed: {self.error}")
            bad = [f"{r}: {f}" for r, f in list(self.finish.items())
                   if f.get("type") == "abort" and f.get("status_code") != 499]
            if bad and what != "finished":
                raise RuntimeError(f"requests failed while waiting for {what}: {bad[:3]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out waiting for {what}")
            time.sleep(0.005)

    def drain(self, quiet: float = 0.15) -> None:
        """Wait until no chunk has arrived for `quiet` seconds (after a pause)."""
        while time.monotonic() - max(self.last_chunk, self.submitted_at) < quiet:
            time.sleep(0.02)

    def first_after(self, t0: float, count: int = 1) -> dict[str, float]:
        """Per request: when its first chunk after t0 arrived (count=1), or when it reached
        `count` tokens in total (count > 1)."""
        got = {}
        with self.lock:
            for rid, ts in self.times.items():
                if count > 1:
                    k = next((i for i, c in enumerate(self.counts[rid]) if c >= count), None)
                else:
                    k = bisect_right(ts, t0)
                    k = k if k < len(ts) else None
                if k is not None:
                    got[rid] = ts[k]
        return got

    def join(self, timeout: float = 60.0) -> None:
        self.thread.join(timeout)
        if self.thread.is_alive():
            self.stopping = True
            self.thread.join(5)


def gaps_in(stream: "Stream", t0: float, t1: float) -> list[float]:
    """Gaps between consecutive chunks of each request, both inside [t0, t1]: the decode
    step period seen by the client."""
    out = []
    with stream.lock:
        for ts in stream.times.values():
            inside = [t for t in ts if t0 < t <= t1]
            out += [b - a for a, b in zip(inside, inside[1:])]
    return out


def make_requests(prefix: str, n: int, lengths: tuple[int, int], vocab: int, max_new: int,
                  rng: random.Random) -> list[tuple[str, list[int], dict]]:
    sampling = {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True}
    return [(f"{prefix}{i}", [rng.randrange(vocab) for _ in range(rng.randint(*lengths))], sampling)
            for i in range(n)]


def end_all(admin: Client, stream: Stream) -> None:
    """End every request of `stream` (pause abort + continue) and wait for their ends."""
    assert admin.admin("pause", mode="abort")["ok"]
    assert admin.admin("continue")["ok"]
    stream.wait_until(lambda: len(stream.finish) == len(stream.reqs), "finished", 60)
    stream.join()


def wait_idle(admin: Client, timeout: float = 30.0) -> None:
    """Until every worker holds no page and no request."""
    deadline = time.monotonic() + timeout
    while True:
        st = admin.admin("status")
        idle = all(w["kv_pages"]["free"] + w["kv_pages"].get("cached", 0) == w["kv_pages"]["total"] and not any(w["queues"].values())
                   for w in st["workers"]) and not st.get("inflight")
        if idle:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"cluster not idle: {st}")
        time.sleep(0.05)
