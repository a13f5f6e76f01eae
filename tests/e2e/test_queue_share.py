"""One caller cannot take the router's queue or its turns from the others (issue 43:
defect 4, and audit 2's held-out "one caller's big call starves the rest"), attacked
over real sockets: `zpd launch --model null --http-port`, a raw ZeroMQ connection as
the flooder, zpd.Client and the HTTP front as the bystanders."""
from __future__ import annotations

import http.client
import threading
import time

import orjson
import pytest
import zmq

from engines.models.null import predict
from engines.sampling_params import SamplingParams
from tests.e2e.cluster import Cluster, assert_all_pages_free
from zpd.wire.net import Dealer
from zpd.wire.protocol import Accepted, Generate, Tokens

pytest.importorskip("mooncake.engine", reason="needs mooncake-transfer-engine(-non-cuda)")

QUEUE = 1200                    # the router's --queue-size
FLOOD = 1400                    # what the flooder sends while paused
PROMPT = [5, 17, 99, 3]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with Cluster(tmp_path_factory.mktemp("queue"), model="null:step_ms=5,prefill_us=20",
                 dtype="bfloat16", extra=("--http-port", "0", "--queue-size", str(QUEUE))) as c:
        yield c


def post(front: str, path: str, body: dict, out: dict, key: str) -> None:
    """POST `body`; `out[key]` = (status, answer, seconds)."""
    host, port = front.rsplit(":", 1)
    began = time.monotonic()
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    try:
        conn.request("POST", path, orjson.dumps(body), {"Content-Type": "application/json"})
        got = conn.getresponse()
        out[key] = (got.status, orjson.loads(got.read()), time.monotonic() - began)
    finally:
        conn.close()


class Flooder:
    """A raw ZeroMQ connection to the router: its requests, each naming another user
    (as the audit's did), and the ends it got back."""

    def __init__(self, router: str) -> None:
        self.ctx = zmq.Context()
        self.dealer = Dealer(self.ctx, router, identity=b"flooder")
        self.accepted: set[str] = set()
        self.ends: dict[str, dict] = {}

    def send(self, n: int) -> None:
        for i in range(n):
            self.dealer.send(Generate(f"flood{i}", PROMPT, SamplingParams(max_new_tokens=2), user=f"u{i}"))

    def read(self, until, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not until() and time.monotonic() < deadline:
            msg = self.dealer.recv(timeout=0.2)
            if isinstance(msg, Accepted):
                self.accepted.update(msg.rids)    # one for the generates read in one go
            elif isinstance(msg, Tokens):
                self.ends |= {p.rid: p.finish for p in msg.unpack() if p.finished}
        assert until(), f"{len(self.accepted)} accepted, {len(self.ends)} ended"

    def refused(self) -> list[str]:
        return [rid for rid, f in self.ends.items() if f.get("status_code") == 429]

    def close(self) -> None:
        self.dealer.close()
        self.ctx.term()


def test_a_flood_that_fills_the_queue_leaves_room_for_other_connections(cluster):
    """While paused, one connection sends more than --queue-size requests: the queue
    fills and its surplus is refused (429). A second connection (zpd.Client) and the
    HTTP front are still admitted, each taking a slot the flood gives up, and are
    answered after continue."""
    flood = Flooder(cluster.router)
    with cluster.client(timeout=120) as admin, cluster.client(timeout=120) as bystander:
        try:
            assert admin.admin("pause", mode="in_place")["ok"]
            began = time.monotonic()
            flood.send(FLOOD)
            flood.read(lambda: len(flood.accepted) == FLOOD and len(flood.refused()) == FLOOD - QUEUE)
            filled = time.monotonic() - began
            assert admin.admin("status")["queued"] == QUEUE
            rid = bystander.submit(input_ids=PROMPT, sampling_params={"max_new_tokens": 3})
            answers: dict = {}
            front = threading.Thread(target=post, args=(cluster.info["http"], "/generate", {
                "input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3}}, answers, "http"))
            front.start()
            # each newcomer's slot is the flood's newest: two more of the flood's end 429
            flood.read(lambda: len(flood.refused()) == FLOOD - QUEUE + 2, timeout=10)
            assert {f"flood{QUEUE - 1}", f"flood{QUEUE - 2}"} <= set(flood.refused())
            why = flood.ends[f"flood{QUEUE - 1}"]["message"]
            assert "this connection holds" in why and "retry later" in why, why
            assert admin.admin("continue")["ok"]
            resumed = time.monotonic()
            got = bystander.receive(timeout=60)
            while not got["finished"]:
                got = bystander.receive(timeout=60)
            assert got["rid"] == rid and got["finish_reason"]["type"] == "length", got
            zmq_wait = time.monotonic() - resumed
            front.join(60)
            status, answer, _ = answers["http"]
            assert status == 200 and answer["meta_info"]["finish_reason"]["type"] == "length", answer
            assert answer["output_ids"] == predict(PROMPT, 3)
            flood.read(lambda: len(flood.ends) == FLOOD)
            assert len(flood.refused()) == FLOOD - QUEUE + 2    # every other one ran
            print(f"\nflood: {QUEUE} queued in {filled:.2f} s, {FLOOD - QUEUE} refused; "
                  f"bystander answered {zmq_wait:.2f} s after continue")
        finally:
            admin.admin("continue")
            flood.close()
        assert_all_pages_free(admin)


def test_a_bystander_from_the_same_address_passes_a_big_calls_backlog(cluster):
    """One /v1/completions of 8 prompts x n=128 (1,024 requests from 127.0.0.1); a
    bystander from the same address, so the same HTTP user, is answered while the big
    call still runs: its call takes turns with the big one."""
    front, got = cluster.info["http"], {}
    big = threading.Thread(target=post, args=(front, "/v1/completions", {
        "prompt": [[7, i, 9] for i in range(8)], "n": 128, "max_tokens": 40,
        "temperature": 1.0}, got, "big"))
    big.start()
    time.sleep(0.5)
    post(front, "/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4}},
         got, "bystander")
    big_done = not big.is_alive()
    big.join(120)
    status, answer, took = got["bystander"]
    assert status == 200 and answer["output_ids"] == predict(PROMPT, 4), answer
    assert got["big"][0] == 200 and len(got["big"][1]["choices"]) == 1024
    print(f"\nbystander answered in {took:.2f} s; the big call in {got['big'][2]:.2f} s")
    assert not big_done and took < got["big"][2] / 2, (took, got["big"][2])
