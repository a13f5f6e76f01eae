"""The fault matrix (issue 4): one deterministic test per failure, on real processes
over loopback with real Mooncake.

Every test checks that the affected requests end with the right status within their
deadline plus SLACK, that the unaffected ones give exactly `zpd run`'s greedy output
(float64, where near-ties cannot flip a token), that the page invariant
free + held + fenced == total holds on every surviving worker and all pages come
back, and that the servers then serve new requests correctly.

States come from fault injection, not sleeps: every KV write of the `delayed`
cluster's prefills waits DELAY seconds in the transport (ZPD_TRANSPORT_FAULT=delay),
so a request is reliably "in transfer" when the test acts on it; a worker paused on
its own holds a request in its queue.

The rows here share one 2P2D cluster. Rows that need a cluster of their own (lost
kv_done/kv_dest via ZPD_DROP_MESSAGES, failed and hung writes, garbage from peers, the
1,000-request load) are in tests/e2e/test_faults_isolated.py; garbage on the bound
sockets is tests/e2e/test_disagg.py::test_garbage_on_every_socket_is_dropped.
"""
from __future__ import annotations

import random
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import zmq

from engines.sampling_params import SamplingParams
from tests.e2e.fault_checks import (DETECT, SLACK, check_correct, ended_within, prompts,
                                    queue_total, reference, router_sees, serves_correctly,
                                    status, submit, warm_up)
from tests.e2e.fault_cluster import TRANSFER, FaultCluster, Proc, Requests, wait_for
from zpd.client import Client
from zpd.env import FAULT_ENV
from zpd.wire.net import Dealer
from zpd.wire.protocol import Generate, Tokens
from zpd.wire.router_proof import load_router_secret, router_identity

pytest.importorskip("mooncake.engine", reason="needs mooncake-transfer-engine(-non-cuda)")

DELAY = 1.0              # seconds every write of the delayed cluster waits
DELAYED_KV_WAIT = 10.0   # the delayed cluster's --kv-wait-timeout
GRACE = 1.0              # its --router-grace: a dead router's requests run on this long


# --- the delayed cluster: 2 prefills, 2 decodes, every write sits DELAY s in transfer ----

@pytest.fixture(scope="module")
def delayed(tmp_path_factory):
    # kv_wait is long here, so a slow abort shows as a timing failure, not a 504
    with FaultCluster(tmp_path_factory.mktemp("delayed"), prefill=2, decode=2,
                      flags=("--transfer-timeout", str(TRANSFER), "--kv-wait-timeout", str(DELAYED_KV_WAIT),
                             "--kv-cache-mb", "8", "--router-grace", str(GRACE)),
                      prefill_env={FAULT_ENV: f"delay:seconds={DELAY}"}) as c:
        warm_up(c)
        yield c



def test_abort_while_writing(delayed):
    work = {f"w{i}": w for i, w in enumerate(prompts(6, seed=1))}
    with delayed.client() as c, delayed.client() as admin, submit(c, work) as reqs:
        wait_for(lambda: queue_total(delayed, delayed.prefills, "writing") == 6, what="6 writes")
        t = time.monotonic()
        for rid in ("w0", "w3"):
            admin.admin("abort", rid=rid)
        outs = reqs.wait()
    for rid in ("w0", "w3"):
        assert status(outs.pop(rid)) == 499
    ended_within(reqs, ["w0", "w3"], t, SLACK)
    check_correct(outs, {rid: work[rid] for rid in outs})
    # the decodes' fences end with the prefills' answers, long before the fence timer
    assert delayed.wait_all_free(timeout=3) < 3
    serves_correctly(delayed)


def test_abort_while_decode_running(delayed):
    with delayed.client() as c, delayed.client() as admin, \
            submit(c, {"long": ([7, 8, 9], 3000)}, stream=True) as reqs:
        wait_for(lambda: reqs.tokens("long") >= 3, what="tokens")
        t = time.monotonic()
        admin.admin("abort", rid="long")
        out = reqs.wait()["long"]
    assert status(out) == 499 and 3 <= len(out["output_ids"]) < 3000
    ended_within(reqs, ["long"], t, SLACK)
    (ref,) = reference([([7, 8, 9], len(out["output_ids"]))])
    assert out["output_ids"] == ref                  # what it sent before the abort is right
    delayed.wait_all_free(timeout=3)
    serves_correctly(delayed)


def test_closing_a_stream_cancels_the_request(delayed):
    with delayed.client() as c:
        stream = c.stream(input_ids=[1, 2, 3], rid="closed",
                          sampling_params={"temperature": 0, "max_new_tokens": 3000, "ignore_eos": True})
        got = [next(stream) for _ in range(3)]
        assert not any(chunk["finished"] for chunk in got)
        stream.close()                                # sends the abort
        t = time.monotonic()
        last = c.receive(timeout=10)
        while not last["finished"]:
            last = c.receive(timeout=10)
    assert last["rid"] == "closed" and last["finish_reason"]["status_code"] == 499
    assert time.monotonic() - t <= SLACK
    with delayed.client() as c:
        assert c.admin("status")["inflight"] == 0
    delayed.wait_all_free(timeout=3)
    serves_correctly(delayed)


def test_abort_while_queued_at_the_router(delayed):
    with delayed.client() as c:
        assert c.admin("pause", mode="in_place")["ok"]
        try:
            rid = c.submit(input_ids=[4, 5, 6], sampling_params={"max_new_tokens": 4})
            wait_for(lambda: c.admin("status")["queued"] == 1, what="queued at the router")
            t = time.monotonic()
            c.abort(rid)
            out = c.receive(timeout=10)
            assert out["rid"] == rid and out["finished"] and out["finish_reason"]["status_code"] == 499
            assert time.monotonic() - t <= SLACK and c.admin("status")["queued"] == 0
        finally:
            assert c.admin("continue")["ok"]
    serves_correctly(delayed)


def _pause_workers(workers: list[Proc], mode: str | None) -> None:
    for w in workers:
        with Client(w.endpoint, timeout=10) as c:
            reply = c.admin("pause", mode=mode) if mode else c.admin("continue")
            assert reply["ok"], reply


@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_abort_while_waiting_at_a_worker(delayed, side):
    """A paused prefill holds a request before computing it; a paused decode holds it
    before it has pages. Abort one of two such requests; the other completes."""
    workers, queue = ((delayed.prefills, "waiting") if side == "prefill"
                      else (delayed.decodes, "waiting_pages"))
    work = {f"{side}-wait{i}": w for i, w in enumerate(prompts(2, seed=3))}
    _pause_workers(workers, "in_place")
    try:
        with delayed.client() as c, delayed.client() as admin, submit(c, work) as reqs:
            wait_for(lambda: queue_total(delayed, workers, queue) == 2, what=f"{side} queue")
            t = time.monotonic()
            admin.admin("abort", rid=f"{side}-wait0")
            wait_for(lambda: f"{side}-wait0" in reqs.done, timeout=SLACK, what="the abort")
            _pause_workers(workers, None)
            outs = reqs.wait()
    finally:
        _pause_workers(workers, None)
    assert status(outs.pop(f"{side}-wait0")) == 499
    ended_within(reqs, [f"{side}-wait0"], t, SLACK)
    check_correct(outs, {rid: work[rid] for rid in outs})
    delayed.wait_all_free(timeout=3)
    serves_correctly(delayed)


@pytest.mark.parametrize("first", ["prefill", "decode"])
def test_pause_in_place_outlasting_the_deadlines_fails_nothing(delayed, first):
    """pause(in_place) on every worker for longer than --kv-wait-timeout. Paused prefills
    first: the decodes have asked for the KV and wait for kv_done, the prefills hold the
    jobs uncomputed. Paused decodes first: the prefills computed the prompts and wait
    for kv_dest, the decodes hold the requests without pages. Either way the requests
    wait as long as the pause, then complete exactly, with no 504."""
    if first == "prefill":
        held, queues = delayed.prefills, ((delayed.prefills, "waiting"), (delayed.decodes, "waiting_kv"))
    else:
        held, queues = delayed.decodes, ((delayed.prefills, "waiting_kv_dest"),
                                         (delayed.decodes, "waiting_pages"))
    work = {f"{first}-held{i}": w for i, w in enumerate(prompts(2, seed=6))}
    _pause_workers(held, "in_place")
    try:
        with delayed.client() as c, submit(c, work) as reqs:
            for workers, queue in queues:
                wait_for(lambda: queue_total(delayed, workers, queue) == 2, what=queue)
            _pause_workers(delayed.workers, "in_place")
            time.sleep(DELAYED_KV_WAIT + 1.0)         # past every phase deadline
            assert not reqs.done, reqs.done
            _pause_workers(delayed.workers, None)
            outs = reqs.wait()
    finally:
        _pause_workers(delayed.workers, None)
    check_correct(outs, work)
    delayed.wait_all_free(timeout=3)


def test_abort_while_prefill_computing(delayed):
    """A 4000-token prompt keeps the prefill's forward busy; the abort is sent as soon as
    the decode has asked for the KV, i.e. while the prefill computes it."""
    rng = random.Random(5)
    long = [rng.randrange(256) for _ in range(4000)]
    with delayed.client() as c, delayed.client() as admin, \
            submit(c, {"computing": (long, 4)}) as reqs:
        wait_for(lambda: queue_total(delayed, delayed.decodes, "waiting_kv") == 1, what="kv_dest")
        t = time.monotonic()
        admin.admin("abort", rid="computing")
        out = reqs.wait()["computing"]
    assert status(out) == 499
    ended_within(reqs, ["computing"], t, SLACK + 1.0)   # + the forward it waits behind
    delayed.wait_all_free(timeout=3)
    serves_correctly(delayed)


@contextmanager
def _in_transfer(cluster: FaultCluster, n: int, seed: int) -> Iterator[tuple[Requests, dict]]:
    """n requests, each with its KV write under way; read on a client of their own,
    closed (after its reader stops) when the block ends."""
    work = {f"t{seed}-{i}": w for i, w in enumerate(prompts(n, seed))}
    with cluster.client() as client, submit(client, work) as reqs:
        wait_for(lambda: queue_total(cluster, cluster.prefills, "writing") == n, what="writes")
        yield reqs, work


def _split_by_victim(outs: dict[str, dict], victim: Proc, work: dict) -> list[str]:
    """The requests the dead worker took with it (503 naming it); all others exact."""
    affected = [rid for rid, o in outs.items() if status(o) == 503]
    for rid in affected:
        assert victim.endpoint in outs[rid]["finish_reason"]["message"], outs[rid]
    fine = {rid: o for rid, o in outs.items() if rid not in affected}
    check_correct(fine, {rid: work[rid] for rid in fine})
    assert affected and fine, (affected, list(fine))
    return affected


def _during_outage(cluster: FaultCluster, victim: Proc) -> None:
    """Once the router has noticed, new requests go to the live workers and are exact
    (pages are checked later: fences for the victim may still stand)."""
    wait_for(lambda: router_sees(cluster, victim, alive=False), timeout=DETECT + SLACK,
             what="the router to mark the victim dead")
    serves_correctly(cluster, n=4, seed=7, free=False)


@pytest.mark.parametrize("sig", ["kill", "stop"])
def test_prefill_dies_or_freezes_mid_transfer(delayed, sig):
    victim = delayed.prefills[0]
    with _in_transfer(delayed, 6, seed=10 + (sig == "stop")) as (reqs, work):
        t = time.monotonic()
        victim.kill() if sig == "kill" else victim.signal(signal.SIGSTOP)
        try:
            outs = reqs.wait()
            affected = _split_by_victim(outs, victim, work)
            ended_within(reqs, affected, t, DETECT + SLACK)
            _during_outage(delayed, victim)
            # A frozen prefill's clock stands still: its write may go on when it wakes, so
            # its pages stay fenced past the fence time (TRANSFER + 5 s) while it is silent.
            time.sleep(max(0.0, t + DETECT + TRANSFER + 5.0 + 0.5 - time.monotonic()))
            fenced = sum(delayed.worker_status(d)["kv_pages"]["fenced"] for d in delayed.decodes)
            assert fenced > 0, "the dead prefill's destination pages must stay fenced"
        finally:
            victim.restart() if sig == "kill" else victim.signal(signal.SIGCONT)
    # a restarted prefill (new session) or a thawed one that answers our kv_failed
    # releases the fences at once
    delayed.wait_all_free(timeout=3)
    wait_for(lambda: router_sees(delayed, victim, alive=True), what="the victim back")
    serves_correctly(delayed)
    warm_up(delayed)                 # a restarted process is a new Mooncake peer to the others


@pytest.mark.parametrize("sig", ["kill", "stop"])
def test_decode_dies_or_freezes_mid_transfer(delayed, sig):
    victim = delayed.decodes[0]
    # one long request decoding on each decode (the router alternates between them)
    long_runs = {f"run{sig}{i}": ([3 + i, 4, 5], 4000) for i in range(2)}
    with delayed.client() as c, submit(c, long_runs, stream=True) as runs:
        wait_for(lambda: all(runs.tokens(r) >= 2 for r in runs.chunks), what="running")
        with _in_transfer(delayed, 6, seed=20 + (sig == "stop")) as (reqs, work):
            t = time.monotonic()
            victim.kill() if sig == "kill" else victim.signal(signal.SIGSTOP)
            try:
                outs = reqs.wait()
                affected = _split_by_victim(outs, victim, work)
                ended_within(reqs, affected, t, DETECT + SLACK)
                wait_for(lambda: len(runs.done) == 1, timeout=DETECT + SLACK,
                         what="the victim's run")
                (lost,) = runs.done.values()
                assert status(lost) == 503 and victim.endpoint in lost["finish_reason"]["message"]
                # the prefills' writes for the dead decode were cancelled: their pages are back
                delayed.wait_all_free(delayed.prefills, timeout=3)
                _during_outage(delayed, victim)
                with delayed.client() as admin:
                    for rid in runs.chunks:
                        admin.admin("abort", rid=rid)
                survivor = [o for r, o in runs.wait().items() if o is not lost][0]
                assert survivor["finish_reason"]["type"] == "length" or status(survivor) == 499
            finally:
                offset = victim.log.stat().st_size
                victim.restart() if sig == "kill" else victim.signal(signal.SIGCONT)
    if sig == "stop":
        # the thawed decode reads the router's aborts and frees everything at once (rather
        # than finishing 4000-token requests whose clients already got a 503), and does not
        # blame its own freeze on its prefills
        delayed.wait_all_free([victim], timeout=3)
        assert "marked dead" not in victim.log.read_text()[offset:]
    wait_for(lambda: router_sees(delayed, victim, alive=True), what="the victim back")
    serves_correctly(delayed)
    warm_up(delayed)                 # a restarted process is a new Mooncake peer to the others


def test_a_thawed_process_does_not_blame_its_peers(delayed):
    """A router or decode that was frozen (or stalled in a long step) sent no pings
    meanwhile, so it heard no pongs: that silence is its own, not its peers'. Right
    after the thaw it must still route to and use every worker."""
    frozen = [delayed.router, delayed.decodes[0]]
    offsets = [p.log.stat().st_size for p in frozen]
    for p in frozen:
        p.signal(signal.SIGSTOP)
    time.sleep(DETECT + 1.0)
    for p in frozen:
        p.signal(signal.SIGCONT)
    serves_correctly(delayed, n=8, seed=41)
    for p, offset in zip(frozen, offsets):
        assert "marked dead" not in p.log.read_text()[offset:], p.name


def test_release_and_resume_memory(delayed):
    """Refused (409) while KV is in use; after pause(retract) every worker drops its
    pool and transport registration, requests wait, and after resume_memory and
    continue they all complete exactly (the decodes told their prefills the new
    pool address before asking for KV again)."""
    work = {f"mem{i}": w for i, w in enumerate(prompts(4, seed=50, max_new=(300, 600)))}
    with delayed.client() as c, delayed.client() as admin, submit(c, work, stream=True) as reqs:
        wait_for(lambda: all(reqs.tokens(r) >= 1 for r in work), what="tokens")
        busy = admin.admin("release_memory")
        # refused by the router itself (requests in flight, not paused): no worker asked
        assert not busy["ok"] and busy["status"] == 409 and "pause first" in busy["error"], busy
        assert {w["memory"] for w in admin.admin("status")["workers"]} == {"resident"}
        try:
            assert admin.admin("pause", mode="retract")["ok"]
            released = admin.admin("release_memory")
            assert released["ok"] and {w["memory"] for w in released["workers"]} == {"released"}
            # the router holds new requests for it (issue 46, item 6), and says so
            assert {w["endpoint"] for w in released["memory_released"]} == \
                {w["endpoint"] for w in released["workers"]}
            late = admin.submit(input_ids=[8, 9], sampling_params={"max_new_tokens": 3})
            assert {w["memory"] for w in admin.admin("status")["workers"]} == {"released"}
            resumed = admin.admin("resume_memory")
            assert resumed["ok"] and {w["memory"] for w in resumed["workers"]} == {"resident"}
            assert resumed["memory_released"] == []
        finally:
            assert admin.admin("continue")["ok"]
        outs = reqs.wait()
        last = admin.receive(timeout=30)
        while not last["finished"]:
            last = admin.receive(timeout=30)
    assert last["rid"] == late and last["finish_reason"]["type"] == "length"
    check_correct(outs, work)
    assert all(o["meta"]["retractions"] == 1 for o in outs.values())
    serves_correctly(delayed)


def test_a_rid_still_running_on_a_decode_is_refused(delayed):
    """E.g. a restarted router given a rid whose orphan still runs: the decode answers
    409 at once instead of dropping the request (which would leave it hanging)."""
    with delayed.client() as c, delayed.client() as admin, \
            submit(c, {"dup": ([1, 2, 3], 4000)}, stream=True) as runs:
        wait_for(lambda: runs.tokens("dup") >= 1, what="tokens")
        (holder,) = [d for d in delayed.decodes if "rid='dup' " in d.log.read_text()]
        ctx = zmq.Context()
        try:
            # a restarted router: proven by the cluster's secret, under a new boot id
            secret = load_router_secret(delayed.security_flags[1])
            raw = Dealer(ctx, holder.endpoint, identity=router_identity("127.0.0.1:1", "restarted", secret))
            raw.send(Generate("dup", [4, 5], SamplingParams(max_new_tokens=2), False, 12345, 0,
                              delayed.prefills[0].endpoint, holder.endpoint))
            reply = raw.recv(timeout=5)
            raw.close()
        finally:
            ctx.destroy(linger=0)       # term() would wait forever on a socket a failure left open
        admin.admin("abort", rid="dup")
        assert status(runs.wait()["dup"]) == 499
    assert isinstance(reply, Tokens), reply
    (part,) = reply.unpack()
    assert part.rid == "dup" and part.finished and part.finish["status_code"] == 409, reply
    delayed.wait_all_free(timeout=3)


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_hangs_up_gets_its_requests_ended(delayed, stream):
    """A client that disconnects with requests in flight must not leave them generating
    to max_new_tokens for no one. Streamed: the next token cannot be delivered; not
    streamed: the router's heartbeat probe finds the client gone. Either way the
    requests end and their pages come back within a heartbeat or two."""
    ctx = zmq.Context()
    try:
        raw = Dealer(ctx, delayed.router.endpoint)
        for rid in ("gone-1", "gone-2"):
            raw.send(Generate(f"{rid}-{stream}", [7, 8, 9], SamplingParams(
                max_new_tokens=3000, ignore_eos=True, temperature=0), stream))
        with delayed.client() as admin:
            wait_for(lambda: queue_total(delayed, delayed.decodes, "running") == 2, what="running")
            raw.close()                              # the client hangs up
            t = time.monotonic()
            wait_for(lambda: admin.admin("status")["inflight"] == 0, timeout=10, what="requests ended")
            assert time.monotonic() - t <= 2 * 0.5 + SLACK
    finally:
        ctx.destroy(linger=0)           # term() would wait forever on a socket a failure left open
    delayed.wait_all_free(timeout=5)
    assert "disconnected: ending its 2 requests" in delayed.router.log.read_text()
    serves_correctly(delayed)


def test_router_killed(delayed):
    """Workers end a dead router's requests (running and in transfer) and free their
    pages, once its grace for a restarted router to adopt them is over."""
    with delayed.client() as c, \
            submit(c, {f"orphan-run{i}": ([9, i, 9], 4000) for i in range(2)}, stream=True) as runs:
        wait_for(lambda: all(runs.tokens(r) >= 2 for r in runs.chunks), what="running")
        with _in_transfer(delayed, 4, seed=30):
            t = time.monotonic()
            delayed.router.kill()
            took = delayed.wait_all_free(timeout=DETECT + GRACE + DELAY + SLACK)
    assert time.monotonic() - t <= DETECT + GRACE + DELAY + SLACK, took
    assert all("ending its" in d.log.read_text() for d in delayed.decodes)
    delayed.start_router()
    serves_correctly(delayed)


