"""`zpd launch --model null`: the simulation's cluster over real processes, ZeroMQ and
Mooncake on loopback. Every token is predicted (engines/models/null.py), so a page the
transport garbled would show."""
from __future__ import annotations

import os
import random
import signal
import threading
import time
from pathlib import Path

import pytest

from engines.models.null import predict
from tests.e2e.cluster import Cluster, assert_all_pages_free
from zpd.client import Client

pytest.importorskip("mooncake.engine", reason="needs mooncake-transfer-engine(-non-cuda)")

STEP_MS = 5


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """2P2D and two routers: the first coordinates, the second follows it."""
    spec = f"null:step_ms={STEP_MS},prefill_us=20,kv_bytes=8192"
    with Cluster(tmp_path_factory.mktemp("null"), prefill=2, decode=2, model=spec,
                 dtype="bfloat16", extra=("--routers", "2")) as c:
        yield c


def test_a_null_2p2d_cluster_answers_the_predicted_tokens(cluster):
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (1, 15, 16, 17, 100, 300) * 3]
    work = [{"input_ids": p, "sampling_params": {"temperature": 0, "max_new_tokens": 20}}
            for p in prompts]
    with cluster.client() as client:
        began = time.monotonic()
        got = client.generate_many(work)
        took = time.monotonic() - began
        assert [g["output_ids"] for g in got] == [predict(p, 20) for p in prompts]
        assert took >= 19 * STEP_MS / 1e3                  # the decode steps take their time
        text = client.generate(prompt="hello", sampling_params={"max_new_tokens": 6})
        assert text["output_ids"] == predict(list(b"hello"), 6)
        assert_all_pages_free(client)


def test_two_routers_serve_one_pool_and_a_pause_through_the_follower_holds_both(cluster):
    """--routers 2: a retract pause sent to the follower (passed on to the coordinator)
    while both routers stream; every request ends with exactly its predicted tokens."""
    rng = random.Random(1)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (3, 40, 200) * 4]
    work = [{"input_ids": p, "sampling_params": {"temperature": 0, "max_new_tokens": 60}}
            for p in prompts]
    coordinator, follower = cluster.info["routers"]
    got: dict[str, list] = {}
    with Client(coordinator, timeout=60) as client:      # launch's secret proves it a router
        assert [f["endpoint"] for f in client.admin("status")["followers"]] == [follower]

    def run(endpoint: str) -> None:
        with Client(endpoint, timeout=60) as client:
            got[endpoint] = client.generate_many(work)

    threads = [threading.Thread(target=run, args=(ep,)) for ep in (coordinator, follower)]
    for t in threads:
        t.start()
    with Client(follower, timeout=60) as admin:
        time.sleep(0.1)                            # mid-stream (60 steps of 5 ms)
        paused = admin.admin("pause", mode="retract")
        assert paused["ok"] and paused["via"] == follower, paused
        assert [f["ok"] for f in paused["followers"]] == [True]
        assert admin.admin("status")["paused"] == "retract"
        assert admin.admin("continue")["ok"]
        for t in threads:
            t.join(60)
        for endpoint in (coordinator, follower):
            assert [g["output_ids"] for g in got[endpoint]] == [predict(p, 60) for p in prompts]
            # the pause came mid-stream: some of each router's requests were retracted
            assert any(g["meta"]["retractions"] for g in got[endpoint]), endpoint
        assert_all_pages_free(admin)


def coordinator_pid(cluster) -> int:
    """The pid of the launch's first router (the one no --coordinator names)."""
    for proc in Path("/proc").iterdir():
        try:
            ppid = int((proc / "stat").read_text().rpartition(")")[2].split()[1])
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue                   # not a process, or gone meanwhile
        if ppid == cluster.proc.pid and b"router" in argv and b"--coordinator" not in argv:
            return int(proc.name)
    raise AssertionError("no coordinator among the launch's children")


def test_a_coordinator_stopped_in_a_pause_strands_nothing_at_its_follower(cluster):
    """Issue 43: SIGSTOP the coordinator while the pool is paused. A request sent to the
    follower ends 503 naming the coordinator within --peer-timeout (2 s) and a heartbeat
    or two, instead of waiting for as long as the coordinator stays stopped; after SIGCONT
    and continue, the follower serves again."""
    coordinator, follower = cluster.info["routers"]
    pid = coordinator_pid(cluster)
    with Client(coordinator, timeout=60) as admin, Client(follower, timeout=10) as client:
        assert admin.admin("pause", mode="retract")["ok"]
        os.kill(pid, signal.SIGSTOP)
        try:
            began = time.monotonic()
            out = client.generate(input_ids=[4, 5, 6], sampling_params={"max_new_tokens": 4})
            waited = time.monotonic() - began
        finally:
            os.kill(pid, signal.SIGCONT)
        reason = out["finish_reason"]
        assert reason["status_code"] == 503 and coordinator in reason["message"], reason
        assert waited < 5.0, waited
        print(f"request at the follower of a stopped coordinator: 503 after {waited:.1f} s")
        assert admin.admin("continue")["ok"]
        time.sleep(1.0)                                # a heartbeat tells the follower
        assert client.generate(input_ids=[4, 5, 6], sampling_params={
            "temperature": 0, "max_new_tokens": 4})["output_ids"] == predict([4, 5, 6], 4)
