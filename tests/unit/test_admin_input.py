"""Admin input is validated before it changes anything (tests/unit/inproc.py): each
bad argument is answered 400 and leaves the router and the workers as they were;
an admin command that fails inside the router is answered 500, never raised out
of its loop."""
from __future__ import annotations


from tests.unit.inproc import InprocCluster, reference
from zpd.wire.net import Dealer
from zpd.wire.protocol import Admin, AdminReply

PROMPT = [5, 17, 99, 3, 42, 7, 250, 1, 64]


def still_serving(c: InprocCluster) -> None:
    """Not paused, timers firing (heartbeats keep both workers alive) and requests served."""
    assert c.router.paused is None and not c.router.queued
    pings = c.router.pings
    c.advance(3 * c.router.cfg.peer_timeout, step=c.router.cfg.heartbeat)
    assert next(pings) > 2 * c.router.cfg.peer_timeout / c.router.cfg.heartbeat
    assert all(w.alive for w in c.router.workers)
    assert c.decode.paused is None and c.prefill.paused is None
    rid = c.submit(PROMPT, 4)
    assert c.run(rid).token_ids == reference(c, PROMPT, 4)
    c.check_pages()


def refused(reply: dict, status: int = 400) -> bool:
    return not reply["ok"] and reply["status"] == status and reply.get("workers", []) == []


def test_bad_pause_is_refused_before_the_router_pauses(cluster):
    for args in ({"mode": "bogus"}, {"mode": 5}, {"mode": None}, {"mode": "retract", "unknown": 1}):
        assert refused(cluster.admin("pause", **args)), args
    still_serving(cluster)


def test_bad_timeout_is_refused_and_timers_keep_firing(cluster):
    cluster.silent.add("decode")          # a fan-out would wait for it: its timer stays
    # (A float NaN or infinity cannot travel: JSON has none, orjson writes null.)
    for timeout in ("nan", "inf", "1e999", -1, 0, "soon", "30", True, [1]):
        req_id = cluster.admin("status", wait=False, timeout=timeout)
        cluster.until(lambda: req_id in cluster.replies, rounds=20)
        assert refused(cluster.replies[req_id]), timeout
    cluster.advance(2 * cluster.router.cfg.peer_timeout)
    decode = next(w for w in cluster.router.workers if w.role == "decode")
    assert not decode.alive                # the heartbeat still runs and noticed
    cluster.silent.clear()
    cluster.until(lambda: decode.alive)
    still_serving(cluster)


def test_a_huge_timeout_is_capped(cluster):
    from zpd.wire.admin_fields import MAX_TIMEOUT_S
    cluster.silent.add("decode")
    req_id = cluster.admin("status", wait=False, timeout=1e300)
    cluster.pump(3)
    (fan,) = cluster.router.admin.fanouts.values()
    assert fan.timer.when <= cluster.clock.now + MAX_TIMEOUT_S
    cluster.silent.clear()
    cluster.until(lambda: req_id in cluster.replies)
    assert cluster.replies[req_id]["ok"]


def test_bad_abort_rid_is_refused(cluster):
    rid = cluster.submit(PROMPT, 30)
    for args in ({}, {"rid": ["r0"]}, {"rid": 5}, {"rid": ""}, {"rid": {"a": 1}}):
        assert refused(cluster.admin("abort", **args)), args
    assert cluster.run(rid).finish["type"] == "length"
    still_serving(cluster)


def test_bad_update_weights_is_refused_and_weights_stay(cluster):
    for args in ({"path": 5}, {"path": ""}, {}, {"path": "tiny:7", "version": 7},
                 {"path": "tiny:7", "version": ["v2"]}):
        assert refused(cluster.admin("update_weights", **args)), args
    assert cluster.prefill.model.version == cluster.decode.model.version == "tiny"
    still_serving(cluster)


def test_arguments_a_command_does_not_take_are_refused(cluster):
    for command in ("status", "continue", "flush_cache"):
        assert refused(cluster.admin(command, mode="abort")), command
    still_serving(cluster)


def test_a_null_version_keeps_the_current_one(cluster):
    """SGLang's update_weights_from_disk without a weight_version keeps the version."""
    assert cluster.admin("update_weight_version", version="mine")["ok"]
    assert cluster.admin("pause", mode="retract")["ok"]
    assert cluster.admin("update_weights", path="tiny:7", version=None)["ok"]
    assert cluster.decode.model.version == cluster.prefill.model.version == "mine"
    assert cluster.admin("continue")["ok"]


def test_a_failing_admin_command_answers_500_and_the_router_lives(cluster, monkeypatch):
    def broken(*_):
        raise RuntimeError("boom")
    monkeypatch.setattr(cluster.router.admin, "abort", broken)
    reply = cluster.admin("abort", rid="r0")
    assert not reply["ok"] and reply["status"] == 500 and "boom" in reply["error"]
    still_serving(cluster)


def _to_worker(c: InprocCluster, endpoint: str, command: str, **args) -> dict:
    # an identity of its own each time: a worker hands no identity in use (the last
    # call's, until its close is seen) to a new connection
    admin = Dealer(c.ctx, endpoint, identity=f"direct-admin-{next(c.rids)}".encode())
    try:
        admin.send(Admin(command, args, "w1"))
        c.until(lambda: admin.socket.poll(0))
        reply = admin.recv()
        assert isinstance(reply, AdminReply)
        return {"ok": reply.ok} | reply.result
    finally:
        admin.close()


def test_a_worker_refuses_bad_update_weights_args(cluster):
    for args in ({"path": "tiny:7", "version": 7}, {"path": "tiny:7", "version": {"v": 2}},
                 {"path": ["tiny:7"]}):
        reply = _to_worker(cluster, cluster.decode.endpoint, "update_weights", **args)
        assert not reply["ok"] and reply["status"] == 400, args
    assert cluster.decode.model.version == "tiny"
    still_serving(cluster)


def test_a_worker_refuses_a_bad_pause_mode(cluster):
    reply = _to_worker(cluster, cluster.prefill.endpoint, "pause", mode=["retract"])
    assert not reply["ok"] and reply["status"] == 400
    still_serving(cluster)
