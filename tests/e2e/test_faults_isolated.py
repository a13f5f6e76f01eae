"""The fault matrix, continued: faults that need a cluster of their own (a lost
message, a failed or hung write, a prefill that rejects what its decode accepts, a
peer that speaks garbage) and the load row (1,000 requests, random aborts, a decode
killed halfway). tests/e2e/test_faults.py has the rest and says what each row checks."""
from __future__ import annotations

import random
import threading
import time

import orjson
import pytest
import zmq

from tests.e2e.cluster import zpd_cmd
from tests.e2e.fault_checks import SLACK, check_correct, serves_correctly, status
from tests.e2e.fault_cluster import FAST, KV_WAIT, TRANSFER, FaultCluster, Proc
from zpd.client import Client, assemble
from zpd.env import DROP_ENV, FAULT_ENV
from zpd.wire.protocol import Ping, Pong, decode, encode

pytest.importorskip("mooncake.engine", reason="needs mooncake-transfer-engine(-non-cuda)")


# --- one fault each: lost messages, failed and hung writes, a prefill that says no ---

SINGLE = {
    "fail": {"prefill_env": {FAULT_ENV: "fail:count=1,reason=injected nic failure"}},
    "hang": {"prefill_env": {FAULT_ENV: "hang:count=1"}},
    "lost_kv_done": {"prefill_env": {DROP_ENV: "kv_done:1"}},
    "lost_kv_dest": {"decode_env": {DROP_ENV: "kv_dest:1"}},
    "small_prefill": {"prefill_flags": ("--kv-cache-mb", "1")},
}


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """One 1P1D cluster per fault, all started at once."""
    clusters = {}
    try:
        for name, kw in SINGLE.items():
            clusters[name] = FaultCluster(tmp_path_factory.mktemp(name), wait=False, **kw)
        for cluster in clusters.values():
            cluster.wait()
        yield clusters
    finally:
        for cluster in clusters.values():
            for p in cluster.procs():
                p.terminate()
        for cluster in clusters.values():
            cluster.stop()


@pytest.mark.parametrize("fault, code, why, bound", [
    ("fail", 500, "injected nic failure", SLACK),
    ("hang", 504, "deadline expired", TRANSFER + SLACK),
    ("lost_kv_done", 504, "deadline expired", KV_WAIT + SLACK),
    ("lost_kv_dest", 504, "deadline expired", KV_WAIT + SLACK),
])
def test_single_fault(single, fault, code, why, bound):
    cluster = single[fault]
    with cluster.client() as c:
        t = time.monotonic()
        out = c.generate(input_ids=[11, 12, 13], sampling_params={"max_new_tokens": 4})
        took = time.monotonic() - t
    assert status(out) == code and why in out["finish_reason"]["message"], out["finish_reason"]
    assert took <= bound, took
    # the prefill answers the decode's kv_failed at once: no waiting for the fence timer
    assert cluster.wait_all_free(timeout=1.5) < 1.5
    serves_correctly(cluster)


def test_request_the_prefill_rejects_fails_on_decode_too(single):
    """Its pool is too small for the prompt; the decode, which has room, must not
    decode from pages nobody wrote."""
    cluster = single["small_prefill"]
    with cluster.client() as c:
        out = c.generate(input_ids=[5] * 1100, sampling_params={"max_new_tokens": 4})
    assert status(out) == 400 and "KV pages" in out["finish_reason"]["message"], out
    cluster.wait_all_free(timeout=2)
    serves_correctly(cluster)


# --- garbage from peers, onto the sockets that connect out ------------------------------

class GarbagePeer:
    """A fake prefill: answers pings (so it looks alive) and everything else with junk."""

    JUNK = [[b"\x00\xff junk"], [b"{}"], [orjson.dumps({"v": 1, "type": "hello_ack", "ok": 7})],
            [orjson.dumps({"v": 1, "type": "kv_done", "room": 1, "epoch": 0, "first_token": 1,
                           "weight_version": "x"})], [b"a", b"b", b"c"]]

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"127.0.0.1:{port}"
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            if not self.sock.poll(50):
                continue
            identity, *frames = self.sock.recv_multipart()
            for junk in self.JUNK:
                self.sock.send_multipart([identity, *junk])
            try:
                msg = decode(frames)
            except ValueError:
                continue
            if isinstance(msg, Ping):
                self.sock.send_multipart([identity, *encode(Pong(msg.seq, msg.sent_at, "fake"))])

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.sock.close()
        self.ctx.term()


def test_garbage_from_peers(tmp_path):
    fake = GarbagePeer()
    decode_ = Proc("decode", zpd_cmd("decode", "--model", "tiny", "--dtype", "float64",
                                     "--kv-cache-mb", "4", "--log-level", "INFO", *FAST),
                   {}, tmp_path, "decode")
    router = Proc("router", zpd_cmd("router", "--prefill", fake.endpoint, "--decode", "PENDING"),
                  {}, tmp_path, "router")
    try:
        decode_.start()
        decode_.wait_ready()
        router.argv[router.argv.index("PENDING")] = decode_.endpoint
        router.start()
        router.wait_ready()
        with Client(router.endpoint, timeout=30) as c:
            t = time.monotonic()
            out = c.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 3})
            # the fake never acknowledges the hello: the decode's deadline ends it
            assert status(out) == 504 and time.monotonic() - t <= KV_WAIT + SLACK, out
        with Client(decode_.endpoint, timeout=10) as c:
            st = c.admin("status")
            assert st["kv_pages"]["free"] + st["kv_pages"]["cached"] == st["kv_pages"]["total"], st   # never asked: no fence
        for p in (decode_, router):
            text = p.log.read_text()
            assert "malformed" in text, f"{p.name} did not log the junk"
            assert p.proc.poll() is None, f"{p.name} died"
    finally:
        router.stop()
        decode_.stop()
        fake.close()


# --- load: 1,000 requests, random aborts, a decode killed halfway ----------------------

LOAD_N, LOAD_WINDOW, LOAD_BOUND = 1000, 64, 30.0


def test_thousand_requests_with_aborts_and_a_killed_decode(tmp_path):
    """Every request ends with length, 499 or 503 within LOAD_BOUND of its submission;
    the finished ones are exact; the survivors' pages all come back."""
    rng = random.Random(42)
    work = {f"load{i}": ([rng.randrange(256) for _ in range(rng.randint(2, 40))], rng.randint(1, 8))
            for i in range(LOAD_N)}
    aborts = {rid: rng.uniform(0, 0.1) for rid in work if rng.random() < 0.1}
    with FaultCluster(tmp_path, prefill=2, decode=2,
                      flags=("--transfer-timeout", "5", "--kv-wait-timeout", str(LOAD_BOUND),
                             "--kv-cache-mb", "8")) as cluster:
        victim = cluster.decodes[0]
        started = time.monotonic()
        outs, submitted, ended = _drive(cluster, work, aborts,
                                        kill_after=LOAD_N * 2 // 5, victim=victim)
        elapsed = time.monotonic() - started
        codes = [status(o) for o in outs.values()]
        assert set(codes) <= {None, 499, 503}, sorted(set(map(str, codes)))
        assert codes.count(503) >= 1 and codes.count(499) >= len(aborts) // 4, \
            (codes.count(503), codes.count(499))
        late = [rid for rid in outs if ended[rid] - submitted[rid] > LOAD_BOUND]
        assert not late, f"{len(late)} requests took longer than {LOAD_BOUND} s"
        finished = {rid: o for rid, o in outs.items() if status(o) is None}
        check_correct(finished, {rid: work[rid] for rid in finished})
        cluster.wait_all_free(timeout=10)
        serves_correctly(cluster)
    print(f"{LOAD_N} requests in {elapsed:.1f} s: {len(finished)} finished, "
          f"{codes.count(499)} aborted, {codes.count(503)} lost with the killed decode")


def _drive(cluster: FaultCluster, work: dict, aborts: dict[str, float], kill_after: int,
           victim: Proc) -> tuple[dict, dict, dict]:
    """Keep LOAD_WINDOW requests in flight; abort some after a random delay; kill the
    victim once `kill_after` requests have ended."""
    pending = list(work)
    submitted: dict[str, float] = {}
    ended: dict[str, float] = {}
    outs: dict[str, dict] = {}
    parts: dict[str, list[dict]] = {}
    due: list[tuple[float, str]] = []
    deadline = time.monotonic() + 4 * LOAD_BOUND + LOAD_N * 0.1
    with cluster.client() as c:
        while len(outs) < len(work):
            assert time.monotonic() < deadline, f"only {len(outs)}/{len(work)} ended"
            while pending and len(submitted) - len(outs) < LOAD_WINDOW:
                rid = pending.pop(0)
                ids, n = work[rid]
                c.submit(input_ids=ids, rid=rid, sampling_params={
                    "temperature": 0, "max_new_tokens": n, "ignore_eos": True})
                submitted[rid] = time.monotonic()
                if rid in aborts:
                    due.append((submitted[rid] + aborts[rid], rid))
            now = time.monotonic()
            for when, rid in [d for d in due if d[0] <= now]:
                due.remove((when, rid))
                c.abort(rid)
            if len(outs) >= kill_after and victim.alive:
                victim.kill()
            try:
                chunk = c.receive(timeout=0.05)
            except TimeoutError:
                continue
            parts.setdefault(chunk["rid"], []).append(chunk)
            if chunk["finished"]:
                outs[chunk["rid"]] = assemble(parts[chunk["rid"]])
                ended[chunk["rid"]] = time.monotonic()
    return outs, submitted, ended


# --- a busy worker is not a dead one ----------------------------------------------------

def test_forwards_longer_than_the_peer_timeout_do_not_kill_workers(tmp_path) -> None:
    """Every forward takes 1.2 s (ZPD_SLOW_CALLS) against a 0.8 s peer timeout: pings
    are answered during the forward (zpd/worker/busy.py), so neither the router nor the
    decode declares a worker dead, and the outputs are exact."""
    from tests.e2e.cluster import Cluster
    from tests.e2e.fault_checks import reference
    from zpd.env import SLOW_ENV
    work = [([5, 6, 7, 8], 2), ([9, 10, 11], 3)]
    with Cluster(tmp_path, extra=("--peer-timeout", "0.8", "--heartbeat", "0.2"),
                 env={SLOW_ENV: "1.2"}) as cluster, cluster.client(timeout=60) as client:
        outs = client.generate_many([{"input_ids": ids, "sampling_params": {
            "temperature": 0, "max_new_tokens": n, "ignore_eos": True}} for ids, n in work])
        assert [o["output_ids"] for o in outs] == reference(work), [o["finish_reason"] for o in outs]
        log = cluster.log.read_text()
    assert "marked dead" not in log and "unavailable" not in log, log[-3000:]
