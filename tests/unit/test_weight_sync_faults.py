"""Trainer weight sync against a broken trainer (issue 30): one that broadcasts more
or fewer bytes than it announced, stalls mid-push, or whose address accepts and
never answers; and an admin's cancel. After each, every worker has its old weights
and version, serves, and a fresh join and push work at once.

The real router and workers run in this process (tests/unit/inproc.py), the trainer
on a thread (tests/unit/trainer_side.py); each worker's group lives in a helper
process (zpd/worker/weights/helper.py), which is what an oversized broadcast kills."""
from __future__ import annotations

import os
import signal
import socket
import threading
import time

import pytest
import torch

from engines.models.tiny import tiny_state_dict
from tests.unit.inproc import InprocCluster
from tests.unit.test_weight_sync import admin, join, push, versions, weights_equal
from tests.unit.trainer_side import Trainer, announce
from zpd.wire.admin import CancelWeightUpdate
from zpd.wire.admin_fields import SyncStep
from zpd.wire.admin_reply import Cancelled
from zpd.worker.weights.helper import FILL, check

W2 = tiny_state_dict(7)
NAMES = list(W2)
LIMIT_S = 3.0          # the admin timeout given: workers get 0.9 of it


@pytest.fixture
def cluster():
    c = InprocCluster(kv_cache_mb=2.0)
    yield c
    c.close()


@pytest.fixture
def trainer():
    t = Trainer(world_size=3, timeout_s=10.0)
    yield t
    t.close()


def broken_push(c: InprocCluster, t: Trainer, sent: list[torch.Tensor], **extra) -> dict:
    """Announce W2, broadcast `sent` instead; the answer."""
    t.push(sent)
    got = admin(c, "update_weights_from_distributed", group_name=t.group_name,
                weight_version="bad", **announce(W2), **extra)
    return got


def unchanged_and_serving(c: InprocCluster) -> None:
    assert versions(c) == ["tiny", "tiny"] and weights_equal(c, "tiny")
    for core in (c.prefill, c.decode):
        assert core.parts["weight_sync"].job is None and core.parts["weight_sync"].staged is None
    assert c.router.admin.sync.step is None
    c.serves_again()


def fresh_push_works(c: InprocCluster) -> None:
    """A new group (the old one may be gone) and a good push, at once."""
    for core in (c.prefill, c.decode):
        for name in list(core.parts["weight_sync"].groups):
            core.parts["weight_sync"]._close(name)
    again = Trainer(world_size=3, group_name="again")
    try:
        assert join(c, again)["ok"]
        reply = push(c, again, W2, version="v2")
        assert reply["ok"], reply
        assert versions(c) == ["v2", "v2"] and weights_equal(c, "tiny:7")
    finally:
        again.close()


def failures(reply: dict) -> list[dict]:
    return [w for w in reply["workers"] if not w["ok"]]


# --- the checks the helper makes on each received tensor ----------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_check_finds_short_and_nan_tensors(dtype):
    good = torch.randn(5, dtype=dtype)
    raw = torch.full((good.nbytes,), FILL, dtype=torch.uint8)
    raw.copy_(good.view(torch.uint8))
    assert check("w", raw, dtype) is None
    for arrived in (0, 1, good.nbytes - 1, good.nbytes - dtype.itemsize):
        raw.fill_(FILL)
        raw[:arrived].copy_(good.view(torch.uint8)[:arrived])
        assert "fewer than" in check("w", raw, dtype), arrived
    nan = good.clone()
    nan[2] = float("nan")
    raw.copy_(nan.view(torch.uint8))
    assert "'w'" in check("w", raw, dtype) and "NaN" in check("w", raw, dtype)


# --- a broken trainer --------------------------------------------------------------


def test_an_oversized_broadcast_kills_only_the_helper(cluster, trainer):
    """gloo aborts the process that receives more bytes than it announced: the helper,
    not the worker. The push fails with the tensor's name and the reason."""
    assert join(cluster, trainer)["ok"]
    sent = list(W2.values())
    sent[1] = torch.cat([sent[1].reshape(-1), torch.zeros(64, dtype=sent[1].dtype)])
    reply = broken_push(cluster, trainer, sent, timeout=20.0)
    trainer.wait()
    assert not reply["ok"]
    bad = failures(reply)
    assert bad and all(NAMES[1] in w["error"] or "died" in w["error"] for w in bad), bad
    assert any("SIGABRT" in w["error"] and NAMES[1] in w["error"] for w in bad), bad
    unchanged_and_serving(cluster)
    assert all(not core.parts["weight_sync"].groups for core in (cluster.prefill, cluster.decode))
    fresh_push_works(cluster)


@pytest.mark.parametrize("short_by", [4, 3, 1])
def test_an_undersized_broadcast_is_refused_and_changes_nothing(cluster, trainer, short_by):
    """Fewer bytes than announced (short_by 1 and 3 end inside an element) is 400 with
    the tensor's name; the group stays in step, so the next push in it works."""
    assert join(cluster, trainer)["ok"]
    sent = list(W2.values())
    raw = sent[2].contiguous().view(-1).view(torch.uint8)
    sent[2] = raw[:raw.numel() - short_by].clone()
    reply = broken_push(cluster, trainer, sent)
    assert trainer.wait() is None
    assert not reply["ok"] and reply.get("weight_version") is None
    bad = failures(reply)
    assert {w["status"] for w in bad} == {400} and len(bad) == 2, bad
    assert all(NAMES[2] in w["error"] and "fewer than" in w["error"] for w in bad), bad
    unchanged_and_serving(cluster)
    assert push(cluster, trainer, W2, version="v2")["ok"]       # the same group still works
    assert versions(cluster) == ["v2", "v2"] and weights_equal(cluster, "tiny:7")


def test_a_nan_weight_is_refused_by_name(cluster, trainer):
    assert join(cluster, trainer)["ok"]
    sent = [t.clone() for t in W2.values()]
    sent[3].view(-1)[0] = float("nan")
    reply = broken_push(cluster, trainer, sent)
    assert trainer.wait() is None
    bad = failures(reply)
    assert {w["status"] for w in bad} == {400} and all(
        NAMES[3] in w["error"] and "NaN" in w["error"] for w in bad), bad
    unchanged_and_serving(cluster)


def stall(t: Trainer, first: int) -> threading.Event:
    """The trainer broadcasts `first` tensors, then waits (group open) until released."""
    go = threading.Event()

    def body() -> None:
        for tensor in list(W2.values())[:first]:
            torch.distributed.broadcast(tensor.contiguous(), src=0, group=t.group)
        go.wait(60)
    t._run(body)
    return go


def test_a_stalled_push_fails_within_the_timeout(cluster, trainer):
    assert join(cluster, trainer)["ok"]
    release = stall(trainer, 2)
    started = time.monotonic()
    reply = admin(cluster, "update_weights_from_distributed", group_name="g", timeout=LIMIT_S,
                  weight_version="bad", **announce(W2))
    took = time.monotonic() - started
    release.set()
    assert not reply["ok"] and took < LIMIT_S + 5, (took, reply)
    bad = failures(reply)
    assert {w["status"] for w in bad} == {504}, bad
    assert all(NAMES[2] in w["error"] and "timed out" in w["error"] for w in bad), bad
    cluster.pump(5)
    assert leftovers() == {"threads": [], "mapped": 0}       # nothing held after a stall
    unchanged_and_serving(cluster)
    fresh_push_works(cluster)


def test_the_workers_weight_sync_timeout_caps_a_longer_admin_timeout(cluster, trainer):
    assert join(cluster, trainer)["ok"]
    for core in (cluster.prefill, cluster.decode):
        core.parts["weight_sync"].timeout_s = 1.5       # as --weight-sync-timeout 1.5
    release = stall(trainer, 1)
    started = time.monotonic()
    reply = admin(cluster, "update_weights_from_distributed", group_name="g", timeout=60.0,
                  **announce(W2))
    took = time.monotonic() - started
    release.set()
    assert {w["status"] for w in failures(reply)} == {504} and took < 1.5 + 5, (took, reply)
    assert all("limit 1.5 s" in w["error"] for w in failures(reply))
    unchanged_and_serving(cluster)


def test_cancel_ends_a_stalled_push_at_once(cluster, trainer):
    assert join(cluster, trainer)["ok"]
    release = stall(trainer, 1)
    req_id = cluster.admin("update_weights_from_distributed", wait=False, group_name="g",
                           weight_version="bad", **announce(W2))
    cluster.until(lambda: all(core.parts["weight_sync"].job for core in (cluster.prefill, cluster.decode)))
    rid = cluster.submit([1, 2, 3], 4)           # queued behind the push
    started = time.monotonic()
    cancel = admin(cluster, "cancel_weight_update")
    assert cancel["ok"] and all(w["cancelled"] == "receiving g" for w in cancel["workers"]), cancel
    end = time.monotonic() + 20
    while req_id not in cluster.replies:
        assert time.monotonic() < end, "the cancelled push never answered"
        cluster.pump(1)
        time.sleep(0.001)
    release.set()
    reply = cluster.replies[req_id]
    assert time.monotonic() - started < 10
    assert not reply["ok"] and all("cancelled by admin" in w["error"] for w in failures(reply))
    assert cluster.run(rid).token_ids                   # the queued request ran
    unchanged_and_serving(cluster)
    fresh_push_works(cluster)


@pytest.mark.parametrize("ends", ["whole", "broken pipe", "unexpected error"])
def test_a_cancel_wins_over_whatever_the_step_made_of_it(cluster, ends):
    """A cancel that lands while a step's thread is finishing (its push arrived whole
    after all, or it broke on the killed helper, or on anything else): the step answers
    the cancel (409), and the worker is idle at once, ready for the next step."""
    ws, outcome = cluster.decode.parts["weight_sync"], []
    go = threading.Event()

    def work(job) -> None:
        go.wait(10)
        if ends == "broken pipe":
            raise BrokenPipeError(32, "Broken pipe")
        if ends == "unexpected error":
            raise KeyError("not an error the step expects")

    ws.background(SyncStep.PUSHING, "g", lambda result, error: outcome.append(error), work)
    replies = []
    ws.cancel(CancelWeightUpdate(), lambda ok, body: replies.append((ok, body)))
    go.set()
    end = time.monotonic() + 10
    while not outcome:
        assert time.monotonic() < end, "the step never finished"
        cluster.pump(1)
        time.sleep(0.001)
    assert replies == [(True, Cancelled("receiving g"))]
    assert getattr(outcome[0], "status", None) == 409 and "cancelled" in str(outcome[0])
    assert ws.job is None


def test_cancel_with_nothing_under_way_changes_nothing(cluster):
    reply = cluster.admin("cancel_weight_update")
    assert reply["ok"] and [w["cancelled"] for w in reply["workers"]] == [None, None]
    cluster.serves_again()


@pytest.fixture
def silent_port():
    """An address that accepts connections and never says a word."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(srv.accept()[0])
            except OSError:
                continue
    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield srv.getsockname()[1]
    stop.set()
    thread.join(5)
    for s in held:
        s.close()
    srv.close()


@pytest.mark.parametrize("cancel", [False, True])
def test_a_join_to_a_silent_port_is_bounded_and_a_retry_works_at_once(cluster, silent_port,
                                                                       cancel):
    started = time.monotonic()
    req_id = cluster.admin("init_weights_update_group", wait=False, master_address="127.0.0.1",
                           master_port=silent_port, rank_offset=1, world_size=3,
                           group_name="g", timeout=LIMIT_S)
    if cancel:
        cluster.until(lambda: all(core.parts["weight_sync"].job for core in (cluster.prefill,
                                                                    cluster.decode)))
        assert admin(cluster, "cancel_weight_update")["ok"]
    end = time.monotonic() + LIMIT_S + 10
    while req_id not in cluster.replies:
        assert time.monotonic() < end, "the join was not bounded"
        cluster.pump(1)
        time.sleep(0.001)
    took, reply = time.monotonic() - started, cluster.replies[req_id]
    # the limit, plus (cold) the helpers' forkserver importing torch; torch alone: never
    assert not reply["ok"] and took < LIMIT_S + 10, (took, reply)
    want = ("cancelled by admin", 409) if cancel else ("timed out", 504)
    assert all(want[0] in w["error"] and w["status"] == want[1]
               for w in failures(reply)), reply
    for core in (cluster.prefill, cluster.decode):
        assert core.parts["weight_sync"].status() == {"weight_groups": [], "weights_staged": False,
                                             "weight_sync_job": None}
    unchanged_and_serving(cluster)
    fresh_push_works(cluster)


# --- the worker's own helper process, killed -----------------------------------------


def helper_pids(c: InprocCluster) -> list[int]:
    """The helper processes of the step under way (or, with none, of the groups)."""
    links = [core.parts["weight_sync"].job.link if core.parts["weight_sync"].job else None
             for core in (c.prefill, c.decode)]
    links += [g.link for core in (c.prefill, c.decode) for g in core.parts["weight_sync"].groups.values()]
    return sorted({link.proc.pid for link in links if link is not None})


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def leftovers() -> dict:
    """What a weight-sync step could leak in this process: its threads, its shared memory."""
    with open("/proc/self/maps") as maps:
        mapped = sum("zpd-weight-push" in line for line in maps)
    return {"threads": [t.name for t in threading.enumerate() if t.name.startswith("zpd-weights")],
            "mapped": mapped}


@pytest.mark.parametrize("step", ["join", "push"])
def test_a_killed_helper_ends_the_step_everywhere_at_once(cluster, trainer, step):
    """SIGKILL of one worker's helper mid-join (the trainer waits for every rank) or
    mid-push (the trainer, alive, sends nothing more): that worker fails at once, and the
    router ends the step on the other at once too instead of leaving it, and every
    request queued behind the push, to wait out its whole limit. Nothing is left behind:
    no helper, thread or shared memory; the old weights serve; a new group works."""
    limit = 20.0
    if step == "push":
        assert join(cluster, trainer)["ok"]
        release = stall(trainer, 2)
        req_id = cluster.admin("update_weights_from_distributed", wait=False, group_name="g",
                               timeout=limit, weight_version="bad", **announce(W2))
    else:                       # the trainer never comes: both workers wait in the rendezvous
        release = threading.Event()
        req_id = cluster.admin("init_weights_update_group", wait=False, master_address="127.0.0.1",
                               master_port=trainer.port, rank_offset=1, world_size=3,
                               group_name="g", backend="gloo", timeout=limit)
    end = time.monotonic() + 30                  # cold: the helpers' forkserver imports torch
    while not all(core.parts["weight_sync"].job and core.parts["weight_sync"].job.link
                  for core in (cluster.prefill, cluster.decode)):
        assert time.monotonic() < end, "the step never started"
        cluster.pump(1)
        time.sleep(0.001)
    pids = helper_pids(cluster)
    assert len(pids) == 2
    time.sleep(0.3)                              # the step is well under way
    os.kill(cluster.decode.parts["weight_sync"].job.link.proc.pid, signal.SIGKILL)
    killed = time.monotonic()
    end = killed + limit + 10
    while req_id not in cluster.replies:
        assert time.monotonic() < end, "no answer"
        cluster.pump(1)
        time.sleep(0.001)
    took, reply = time.monotonic() - killed, cluster.replies[req_id]
    release.set()
    assert not reply["ok"] and took < 5, (took, reply)
    bad = {w["role"]: w for w in failures(reply)}
    assert bad["decode"]["status"] == 500 and "died of SIGKILL" in bad["decode"]["error"], bad
    assert bad["prefill"]["status"] == 409 and f"{step} failed on decode" in \
        bad["prefill"]["error"], bad
    cluster.pump(5)
    assert all(gone(pid) for pid in pids), pids
    assert leftovers() == {"threads": [], "mapped": 0}
    assert all(not core.parts["weight_sync"].groups for core in (cluster.prefill, cluster.decode))
    unchanged_and_serving(cluster)
    fresh_push_works(cluster)
    assert leftovers() == {"threads": [], "mapped": 0}


def test_a_failed_push_frees_its_shared_memory_at_once(cluster, trainer):
    """The memory a push is received into (as large as the push) goes when the push
    fails, not whenever the cyclic garbage collector next runs (the step's error held
    it through its traceback)."""
    assert join(cluster, trainer)["ok"]
    assert not push(cluster, trainer, W2, stop_after=3)["ok"]          # the trainer dies
    cluster.pump(5)
    assert leftovers() == {"threads": [], "mapped": 0}
    unchanged_and_serving(cluster)


def test_a_worker_that_dies_mid_push_ends_the_push_when_it_is_marked_dead(cluster, trainer):
    """The decode falls silent mid-push (killed or frozen): once the router marks it dead
    (its peer timeout, 2 s here), the push answers 503 naming it, the prefill's receive
    is ended, and queued requests run, instead of all waiting for the push's limit."""
    assert join(cluster, trainer)["ok"]
    req_id = cluster.admin("update_weights_from_distributed", wait=False, group_name="g",
                           timeout=120.0, weight_version="bad", **announce(W2))
    cluster.until(lambda: all(core.parts["weight_sync"].job for core in (cluster.prefill, cluster.decode)))
    cluster.silent.add("decode")
    cluster.advance(4.0)                  # past the peer timeout, far short of the push's
    end = time.monotonic() + 10
    while req_id not in cluster.replies:
        assert time.monotonic() < end, "the push waited on a dead worker"
        cluster.pump(1)
        time.sleep(0.001)
    reply = cluster.replies[req_id]
    bad = {w["role"]: w for w in failures(reply)}
    assert bad["decode"]["status"] == 503 and "ended early" in bad["prefill"]["error"], reply
    cluster.silent.discard("decode")
    cluster.advance(2.0)
    assert cluster.admin("cancel_weight_update")["ok"]      # the decode, back, ends its own
    end = time.monotonic() + 10
    while cluster.decode.parts["weight_sync"].job is not None:
        assert time.monotonic() < end
        cluster.pump(1)
        time.sleep(0.001)
    unchanged_and_serving(cluster)
    fresh_push_works(cluster)
