"""Issue 34 item 3, the fronts' half: `zpd http --workers 2 --router A,B` over a 1P1D
null cluster with two routers (B follows A). Both fronts and both routers answer; after
kill -9 of B, requests in flight end (503 once B has been silent for the client's
router_silence, or done; never a hang) and new requests through the fronts and through
zpd.Client([A, B]) still succeed."""
from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import orjson
import pytest
import requests

from engines.models.null import predict
from tests.e2e.cluster import ROOT, Cluster, zpd_cmd
from zpd.client import Client
from zpd.wire.router_proof import write_router_secret

pytest.importorskip("mooncake.engine", reason="needs mooncake-transfer-engine(-non-cuda)")

NEW = 4
LONG = 1000       # tokens: 2 s or more at 2 ms a step


def start(tmp, name: str, *args: str) -> tuple[subprocess.Popen, dict]:
    ready = tmp / f"{name}.json"
    proc = subprocess.Popen(zpd_cmd(*args, "--ready-file", str(ready)), cwd=ROOT,
                            stdout=open(tmp / f"{name}.log", "wb"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert proc.poll() is None and time.monotonic() < deadline, \
            (tmp / f"{name}.log").read_text()[-3000:]
        time.sleep(0.05)
    return proc, orjson.loads(ready.read_bytes())


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def generate(url: str, prompt: list[int], max_new: int = NEW, stream: bool = False) -> dict:
    """One /generate on a connection of its own (so the kernel picks a front); the last
    chunk of a stream."""
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": max_new,
                                                     "ignore_eos": True}, "stream": stream}
    with requests.post(f"{url}/generate", json=body, timeout=30, stream=stream,
                       headers={"Connection": "close"}) as r:
        assert r.status_code == 200, r.text
        if not stream:
            return r.json()
        events = [line[6:] for line in r.iter_lines() if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]"
    return orjson.loads(events[-2])


def metric(url: str, name: str, want: float) -> bool:
    """Whether /metrics shows `name` at `want` within 5 s (each front writes its
    histograms every second; a scrape sums them, whichever front answers it)."""
    seen = []
    for _ in range(25):
        text = requests.get(f"{url}/metrics", headers={"Connection": "close"}, timeout=10).text
        seen.append(next(float(line.split()[-1]) for line in text.splitlines()
                         if line.startswith(name + " ")))
        if seen[-1] == want:
            return True
        time.sleep(0.2)
    raise AssertionError(f"{name}: {seen}, want {want}")


def routed(endpoint: str) -> int:
    with Client(endpoint, timeout=10) as c:
        return sum(c.admin("status")["counters"]["finished"].values())


def test_two_fronts_over_two_routers_share_the_load_and_survive_a_router_kill(tmp_path):
    secret = ("--router-secret-file", str(write_router_secret(tmp_path / "router.secret")))
    with Cluster(tmp_path, model="null:step_ms=2", dtype="bfloat16", extra=secret) as cluster:
        workers = {w["role"]: w["endpoint"] for w in cluster.info["workers"]}
        a = cluster.router
        router_b, info_b = start(tmp_path, "router_b", "router", "--prefill", workers["prefill"],
                                 "--decode", workers["decode"], "--port", "0", "--coordinator", a,
                                 *secret)          # B proves to A that it is a router
        b = info_b["endpoint"]
        http, info = start(tmp_path, "http", "http", "--workers", "2", "--router", f"{a},{b}",
                           "--model", "null", "--port", "0")
        try:
            url = f"http://{info['endpoint']}"
            assert len(info["workers"]) == 2
            prompts = [[i, i + 1, i + 2] for i in range(24)]
            for p in prompts:
                assert generate(url, p)["output_ids"] == predict(p, NEW)
            pids = {requests.get(f"{url}/get_server_info", headers={"Connection": "close"},
                                 timeout=10).json()["zpd"]["front_pid"] for _ in range(16)}
            assert pids == set(info["workers"])             # both fronts answer
            assert routed(a) > 0 and routed(b) > 0          # both routers route
            assert routed(a) + routed(b) == len(prompts)
            # each front's latencies and both routers' counters, whichever front answers
            assert metric(url, "zpd:e2e_request_latency_seconds_count", len(prompts))
            assert metric(url, "zpd:generation_tokens_total", len(prompts) * NEW)

            with Client([a, b], timeout=30, connect_timeout=2, router_silence=3) as client:
                client.routers.first = 1                # its own router: B, the one killed
                long = {"max_new_tokens": LONG, "ignore_eos": True}
                rids = [client.submit(input_ids=[7, i], sampling_params=long, stream=True)
                        for i in range(4)]
                ends: list[tuple[dict, float]] = []        # (finish_reason, when)

                def stream(i: int) -> None:
                    last = generate(url, [9, i], LONG, stream=True)
                    ends.append((last["meta_info"]["finish_reason"], time.monotonic()))
                threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
                for t in threads:
                    t.start()
                streaming: set[str] = set()
                while streaming != set(rids):               # the client's decoding on B
                    streaming.add(client.receive(timeout=30)["rid"])
                time.sleep(0.3)                             # the fronts' too
                router_b.kill()                             # SIGKILL
                router_b.wait()
                killed = time.monotonic()
                left = set(rids)
                while left:
                    chunk = client.receive(timeout=30)
                    if chunk["finished"]:
                        left.discard(chunk["rid"])
                        ends.append((chunk["finish_reason"], time.monotonic()))
                for t in threads:
                    t.join(30)
                assert not any(t.is_alive() for t in threads) and len(ends) == 8
                lost = [when - killed for f, when in ends if f["type"] != "length"]
                assert all(f["type"] == "length" or f["status_code"] == 503 for f, _ in ends), [f.get("message") for f, _ in ends]
                assert len(lost) >= len(rids)           # the client's, at least, were on B
                # B's waited for B to come back (a resume) for router_silence: the
                # client's 3 s, the fronts' 10 s; then ended, none hung
                assert max(lost) < 16, [(round(w - killed, 1), f.get("message")) for f, w in ends]
                after = [[5, i] for i in range(8)]
                for p in after:                             # the fronts: A only now
                    assert generate(url, p)["output_ids"] == predict(p, NEW)
                got = client.generate_many([{"input_ids": p, "sampling_params":
                                             {"max_new_tokens": NEW, "ignore_eos": True}}
                                            for p in after])
                assert [g["output_ids"] for g in got] == [predict(p, NEW) for p in after]
        finally:
            stop(http)
            stop(router_b)
