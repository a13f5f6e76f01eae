"""Issue 34, item 4: kill -9 the router of a 2P2D null cluster in the middle of its
streams, start `zpd router` again on the same port, and account for every request.

The same zpd.Client reads on: each request ends either complete, with exactly the
null model's predicted tokens (none lost, none twice), or with a 503 saying the
router restarted; none hangs, and every KV page comes back. Most requests run 8-12 s
(40 ms steps), longer than the restart: they must all complete. A few end within a
second of the kill, while no router listens: their decode keeps their answers for
the new router, unless one ended in the step before the decode saw the router gone
(then it is lost: 503)."""
from __future__ import annotations

import random
import subprocess
import sys
import time

import orjson

import pytest
import zmq

from engines.models.null import predict
from tests.e2e.cluster import ROOT
from tests.e2e.fault_cluster import FaultCluster
from zpd.client import Client, assemble
from zpd.wire.net import Dealer
from zpd.wire.protocol import Ping, Pong

pytest.importorskip("mooncake.engine", reason="needs mooncake-transfer-engine(-non-cuda)")

STEP_MS = 40
MODEL = f"null:step_ms={STEP_MS},prefill_us=20,kv_bytes=1024"
N_STREAMED, N_WHOLE, N_SHORT = 16, 4, 4


def read_until(client: Client, chunks: dict, done, deadline: float) -> None:
    while not done() and time.monotonic() < deadline:
        try:
            chunk = client.receive(timeout=0.5)
        except TimeoutError:
            continue
        chunks[chunk["rid"]].append(chunk)


def router_boot(endpoint: str) -> str:
    """The router's boot id, as any client learns it (in the answer to a ping)."""
    ctx = zmq.Context()
    try:
        probe = Dealer(ctx, endpoint)
        probe.send(Ping(1, 0.0))
        return next(m.boot for m in iter(lambda: probe.recv(timeout=10), None)
                    if isinstance(m, Pong))
    finally:
        ctx.destroy(linger=0)


def forge(cluster, boot: str) -> dict:
    """Run tests/e2e/forged_router.py against the decodes: what it was handed."""
    out = subprocess.run([sys.executable, "-m", "tests.e2e.forged_router", cluster.router.endpoint,
                          boot, *[d.endpoint for d in cluster.decodes]], cwd=ROOT,
                         capture_output=True, timeout=30, check=True)
    return orjson.loads(out.stdout.splitlines()[-1])


def test_a_router_killed_mid_stream_and_restarted_loses_no_running_request(tmp_path):
    rng = random.Random(34)
    work = {f"r{i}": ([rng.randrange(256) for _ in range(rng.randrange(5, 60))],
                      rng.randrange(200, 300), i < N_STREAMED)
            for i in range(N_STREAMED + N_WHOLE)}
    # streamed, and over well before the router is back: their answers go to the dead one
    work |= {f"short{i}": ([rng.randrange(256) for _ in range(9)], 15, True) for i in range(N_SHORT)}
    flags = ("--model", MODEL, "--kv-cache-mb", "16", "--transfer-timeout", "5")
    with FaultCluster(tmp_path, prefill=2, decode=2, dtype="bfloat16", flags=flags) as cluster, \
            Client(cluster.router.endpoint, timeout=60) as client:
        chunks: dict[str, list[dict]] = {rid: [] for rid in work}
        for rid, (prompt, n, stream) in work.items():
            client.submit(input_ids=prompt, rid=rid, stream=stream,
                          sampling_params={"temperature": 0, "max_new_tokens": n})
        had = lambda rid: sum(len(c["token_ids"]) for c in chunks[rid])   # noqa: E731
        read_until(client, chunks, lambda: all(had(r) >= 3 for r in work if work[r][2]),
                   time.monotonic() + 30)
        assert all(had(r) >= 3 for r in work if work[r][2]), "the streams did not start"
        boot = router_boot(cluster.router.endpoint)
        cluster.router.kill()                          # kill -9
        # issue 43: in the gap, a process named after the router asks the decodes to adopt
        stolen = forge(cluster, boot)
        assert stolen == {"adopted": 0, "tokens": 0}, stolen
        began = time.monotonic()
        cluster.router.start(cluster.router.port)      # then the same port
        cluster.router.wait_ready()
        restarted = time.monotonic() - began
        finished = lambda: all(c and c[-1]["finished"] for c in chunks.values())   # noqa: E731
        read_until(client, chunks, finished, time.monotonic() + 45)
        assert finished(), {r: had(r) for r, c in chunks.items() if not (c and c[-1]["finished"])}
        outcome = {"complete": [], "503": []}
        for rid, (prompt, n, _) in work.items():
            out = assemble(chunks[rid])
            if out["finish_reason"]["type"] == "length":
                assert out["output_ids"] == predict(prompt, n), rid     # none lost, none twice
                outcome["complete"].append(rid)
            else:
                assert out["finish_reason"]["status_code"] == 503, out["finish_reason"]
                assert "router restarted" in out["finish_reason"]["message"], out["finish_reason"]
                outcome["503"].append(rid)
        print(f"router restart after kill -9 ({restarted:.1f} s to ready): "
              f"{len(outcome['complete'])} of {len(work)} requests complete with every token, "
              f"{len(outcome['503'])} ended 503 {sorted(outcome['503'])}")
        assert not [r for r in outcome["503"] if not r.startswith("short")], outcome
        cluster.wait_all_free(timeout=30)
