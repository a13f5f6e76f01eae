"""Issue 43, item 3: the router's restart under --curve-keys. kill -9 the router of a
keyed null cluster in the middle of its streams, start it again on its port: zpd.Client
with a client key and with the admin key, and an HTTP front (the admin key), resume
their requests, which end complete with exactly the null model's tokens. Before the fix the router refused
`resume` from both keys ("resume needs 'cluster' rights") and the streams never ended."""
from __future__ import annotations

import threading
import time

import pytest
import zmq

from engines.models.null import predict
from tests.e2e.fault_cluster import FaultCluster
from tests.e2e.test_fronts_failover import generate, start, stop
from tests.e2e.test_router_restart_kill import read_until
from zpd.client import Client, assemble
from zpd.wire.net import Dealer, SocketOptions
from zpd.wire.protocol import Ping, Pong, Tokens
from zpd.wire.security import client_curve, create_keys

pytest.importorskip("mooncake.engine", reason="needs mooncake-transfer-engine(-non-cuda)")
pytestmark = pytest.mark.skipif(not zmq.has("curve"), reason="libzmq built without CURVE")

MODEL = "null:step_ms=40,prefill_us=20,kv_bytes=1024"
N = 150           # 6 s of steps: well past the restart
HTTP_PROMPT = [9, 8, 7, 6]


def steal_route(cluster: FaultCluster, keys) -> int:
    """What a client key gets by connecting to the decode under the router's name as any
    client learns it (endpoint and boot id, from a Pong): before issue 43 that was the
    router's identity, and ROUTER_HANDOVER gave this connection its route. Counts the
    token messages that reach it in 1.5 s."""
    ctx, opts = zmq.Context(), SocketOptions(curve=client_curve(keys))
    try:
        probe = Dealer(ctx, cluster.router.endpoint, opts=opts)
        probe.send(Ping(1, 0.0))
        pong = next(m for m in iter(lambda: probe.recv(timeout=5), None) if isinstance(m, Pong))
        name = f"router@{cluster.router.endpoint}/{pong.boot}".encode()
        thief = Dealer(ctx, cluster.decodes[0].endpoint, identity=name, opts=opts)
        thief.send(Ping(1, 0.0))
        stolen, until = 0, time.monotonic() + 1.5
        while (left := until - time.monotonic()) > 0:
            stolen += isinstance(thief.recv(timeout=left), Tokens)
        return stolen
    finally:
        ctx.destroy(linger=0)


def test_a_keyed_router_killed_mid_stream_resumes_every_keyed_clients_request(tmp_path):
    keys = tmp_path / "keys"
    create_keys(keys)
    flags = ("--model", MODEL, "--kv-cache-mb", "16", "--transfer-timeout", "5")
    prompts = {f"{who}{i}": [i + 1, 2 * i + 3, 7] for who in ("client", "admin") for i in range(2)}
    with FaultCluster(tmp_path, dtype="bfloat16", flags=flags, curve_keys=keys) as cluster, \
            Client(cluster.router.endpoint, timeout=60, curve=client_curve(keys)) as client, \
            Client(cluster.router.endpoint, timeout=60, curve=client_curve(keys, "admin")) as admin:
        # the HTTP front connects with the admin key and resumes through the restart too
        front, info = start(tmp_path, "http", "http", "--router", cluster.router.endpoint,
                            "--model", "null", "--port", "0", "--curve-keys", str(keys))
        http: list[dict] = []
        streaming = threading.Thread(target=lambda: http.append(generate(
            f"http://{info['endpoint']}", HTTP_PROMPT, N, stream=True)))
        streaming.start()
        try:
            chunks: dict[str, list[dict]] = {rid: [] for rid in prompts}
            for rid, prompt in prompts.items():
                (client if rid.startswith("client") else admin).submit(
                    input_ids=prompt, rid=rid, stream=True,
                    sampling_params={"temperature": 0, "max_new_tokens": N})
            had = lambda rid: sum(len(c["token_ids"]) for c in chunks[rid])   # noqa: E731
            done = lambda: all(c and c[-1]["finished"] for c in chunks.values())   # noqa: E731
            for reader in (client, admin):
                mine = [r for r in prompts if (r.startswith("client")) == (reader is client)]
                read_until(reader, chunks, lambda: all(had(r) >= 3 for r in mine),
                           time.monotonic() + 30)
            assert all(had(r) >= 3 for r in prompts), "the streams did not start"
            assert steal_route(cluster, keys) == 0         # issue 43, item 2, with a client key
            cluster.router.restart()                       # kill -9, then the same port
            deadline = time.monotonic() + 30
            while not done() and time.monotonic() < deadline:
                for reader in (client, admin):
                    try:
                        chunk = reader.receive(timeout=0.2)
                        chunks[chunk["rid"]].append(chunk)
                    except TimeoutError:
                        pass
            assert done(), {r: had(r) for r, c in chunks.items() if not (c and c[-1]["finished"])}
            streaming.join(30)
            assert http and http[0]["meta_info"]["finish_reason"]["type"] == "length", http
            assert http[0]["output_ids"] == predict(HTTP_PROMPT, N)
            for rid, prompt in prompts.items():
                out = assemble(chunks[rid])
                assert out["finish_reason"]["type"] == "length", (rid, out["finish_reason"])
                assert out["output_ids"] == predict(prompt, N), rid
        finally:
            stop(front)
        cluster.wait_all_free(timeout=30)
