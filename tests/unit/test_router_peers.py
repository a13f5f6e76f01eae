"""Two routers over one pool of workers (zpd/router/ha/peers.py): both serve, the
coordinator's pauses, continues, weight pushes and abort_all hold across both, a
follower passes admin commands on, and neither needs the other to serve. In one
process: the real routers and workers of tests/unit/inproc.py, plus a follower."""
from __future__ import annotations

import pytest
import torch.multiprocessing as mp

from engines.sampling_params import SamplingParams
from tests.unit.inproc import Answer, InprocCluster, reference
from tests.unit.test_tensor_payload import serialize
from tests.unit.test_weight_sync_sglang import W2
from zpd.config import RouterConfig
from zpd.ops.router import build_router
from zpd.wire.admin_fields import PauseMode, SyncStep
from zpd.wire.loop import Loop
from zpd.wire.net import Dealer
from zpd.wire.protocol import Admin, AdminReply, Generate, Tokens

PROMPT = [5, 17, 99, 3, 42, 7, 250, 1, 64, 31, 8, 200, 13, 77, 150, 9, 21]


class Pair:
    """An InprocCluster whose router coordinates, plus a second router following it,
    with a client of its own."""

    def __init__(self, **router_args) -> None:
        self.c = c = InprocCluster(kv_cache_mb=2.0)
        tag = c.router.endpoint.rsplit("r", 1)[-1]
        self.follower = build_router(RouterConfig(
            (c.prefill.endpoint,), (c.decode.endpoint,), host=f"inproc://f{tag}", heartbeat=0.5,
            peer_timeout=2.0, coordinator=c.router.endpoint, router_secret_file=c.secret_file,
            **router_args), c.ctx,
            Loop(clock=c.clock))
        self.client = Dealer(c.ctx, self.follower.endpoint, identity=b"fclient")
        self.answers: dict[str, Answer] = {}
        self.replies: dict[str, dict] = {}
        self.ids = 0
        self.follower_silent = False
        c.pump = self.pump             # every wait of the cluster turns the follower too
        self._pump = InprocCluster.pump.__get__(c)
        self.c.advance(1.0)            # a heartbeat: the follower is known

    def pump(self, rounds: int = 30) -> None:
        for _ in range(rounds):
            self._pump(1)
            if not self.follower_silent:
                self.follower.loop.run_once(max_wait=0)
            while (msg := self.client.recv()) is not None:
                if isinstance(msg, AdminReply):
                    self.replies[msg.req_id] = {"ok": msg.ok} | msg.result
                for part in msg.unpack() if isinstance(msg, Tokens) else []:
                    got = self.answers.setdefault(part.rid, Answer())
                    got.token_ids += part.token_ids
                    got.weight_versions += part.weight_versions
                    if part.finished:
                        got.finish = part.finish

    def submit(self, rid: str, max_new: int = 8) -> str:
        self.client.send(Generate(rid, PROMPT, SamplingParams(temperature=0, max_new_tokens=max_new,
                                                              ignore_eos=True), True))
        return rid

    def run(self, rid: str) -> Answer:
        self.c.until(lambda: rid in self.answers and self.answers[rid].finish is not None)
        return self.answers[rid]

    def admin(self, command: str, **args) -> dict:
        self.ids += 1
        req_id = f"fa{self.ids}"
        self.client.send(Admin(command, args, req_id))
        self.c.until(lambda: req_id in self.replies)
        return self.replies[req_id]

    def close(self) -> None:
        self.client.close()
        self.follower.close()
        self.c.close()


@pytest.fixture
def pair():
    p = Pair()
    yield p
    p.close()


def test_both_routers_serve_and_know_each_other(pair):
    c, want = pair.c, reference(pair.c, PROMPT, 8)
    mine = [c.submit(PROMPT, 8) for _ in range(2)]
    theirs = [pair.submit(f"f{i}") for i in range(2)]
    for rid in mine:
        assert c.run(rid).token_ids == want
    for rid in theirs:
        assert pair.run(rid).token_ids == want
    status = c.admin("status")
    assert status["followers"] == [{"endpoint": pair.follower.endpoint, "inflight": 0}]
    assert pair.admin("status")["coordinator"] == {"endpoint": c.router.endpoint, "alive": True}
    assert c.router.tally.generation_tokens == pair.follower.tally.generation_tokens == 16
    c.check_pages()


@pytest.mark.parametrize("via_follower", [False, True])
def test_a_retract_pause_holds_both_routers_and_continue_resumes_both(pair, via_follower):
    c, want = pair.c, reference(pair.c, PROMPT, 24)
    mine = c.submit(PROMPT, 24)
    pair.submit("f-run", 24)
    c.until(lambda: len(c.answers.get(mine, Answer()).token_ids) >= 2
            and len(pair.answers.get("f-run", Answer()).token_ids) >= 2)
    ask = pair.admin if via_follower else c.admin
    reply = ask("pause", mode="retract")
    assert reply["ok"], reply
    assert reply["followers"] == [{"ok": True, "endpoint": pair.follower.endpoint, "inflight": 1,
                                   "early": {}}]
    assert ("via" in reply) is via_follower and reply["router"] == c.router.endpoint
    assert c.router.paused is pair.follower.paused is PauseMode.RETRACT
    held = pair.submit("f-held")                  # new requests wait at both routers
    c.pump()
    assert list(pair.follower.queued) == [held] and held not in pair.follower.inflight
    reply = ask("continue")
    assert reply["ok"], reply
    assert c.router.paused is None and pair.follower.paused is None
    assert c.run(mine).token_ids == want
    assert pair.run("f-run").token_ids == want
    assert pair.run(held).token_ids == reference(c, PROMPT, 8)
    c.check_pages()


def test_pause_abort_ends_what_runs_and_waits_at_the_follower():
    pair = Pair(max_concurrent_requests=1)          # the follower's second request waits
    try:
        c = pair.c
        running, waiting = pair.submit("f-run", 200), pair.submit("f-wait")
        c.until(lambda: len(pair.answers.get(running, Answer()).token_ids) >= 1)
        assert list(pair.follower.queued) == [waiting]
        reply = c.admin("pause", mode="abort")
        assert reply["ok"], reply
        assert pair.run(waiting).finish["status_code"] == 499
        assert pair.run(running).finish["status_code"] == 499
        assert c.admin("continue")["ok"]
        assert pair.run(pair.submit("after")).token_ids == reference(c, PROMPT, 8)
        c.check_pages()
    finally:
        pair.close()


def test_abort_all_and_abort_reach_the_follower(pair):
    c = pair.c
    mine = c.submit(PROMPT, 200)
    theirs = [pair.submit("f-a", 200), pair.submit("f-b", 200)]
    c.until(lambda: len(pair.answers.get("f-b", Answer()).token_ids) >= 1)
    reply = c.admin("abort", rid="f-a")             # a rid of the follower's, found there
    assert reply["ok"] and reply["state"] == "inflight", reply
    assert pair.run("f-a").finish["status_code"] == 499
    reply = pair.admin("abort_all")                  # passed on, run everywhere
    assert reply["ok"] and reply["aborted"] == 2, reply
    assert c.run(mine).finish["status_code"] == 499
    assert pair.run(theirs[1]).finish["status_code"] == 499
    assert c.admin("abort", rid="nobody")["status"] == 404
    # a front names a caller's rid "<space>:rid"; any router finds it by the caller's name
    pair.submit("anon.1f2e3d4c:mine", 200)
    c.until(lambda: "anon.1f2e3d4c:mine" in pair.follower.inflight)
    reply = c.admin("abort", rid="mine")
    assert reply["ok"] and reply["rids"] == ["anon.1f2e3d4c:mine"], reply
    assert pair.run("anon.1f2e3d4c:mine").finish["status_code"] == 499
    c.pump()
    c.check_pages()


def test_a_push_holds_the_follower_until_its_end(pair):
    c = pair.c
    c.router.admin.sync.step = SyncStep.PUSHING      # as two_phase sets it, then tells
    c.router.followers.tell(lambda _: None, 1.0)
    c.pump()
    assert pair.follower.holding and pair.follower.paused is None
    rid = pair.submit("f-push")
    c.pump()
    assert list(pair.follower.queued) == [rid]
    c.router.admin.sync.step = None
    c.router.unpause()
    assert pair.run(rid).token_ids == reference(c, PROMPT, 8)


def test_update_from_tensor_through_the_follower_moves_every_worker(pair):
    before = mp.get_sharing_strategy()      # SGLang's trainers share CPU tensors this way
    mp.set_sharing_strategy("file_system")
    try:
        reply = pair.admin("update_weights_from_tensor", weight_version="t1",
                           serialized_named_tensors=[serialize(list(W2.items()))])
    finally:
        mp.set_sharing_strategy(before)
    assert reply["ok"] and reply["weight_version"] == "t1" and "via" in reply, reply
    assert not pair.follower.holding                  # the push's end released it
    assert pair.run(pair.submit("after")).weight_versions == ["t1"] * 8


def test_update_weights_is_refused_while_the_follower_has_requests(pair):
    c = pair.c
    pair.submit("f-long", 200)
    c.until(lambda: len(pair.answers.get("f-long", Answer()).token_ids) >= 1)
    c.advance(0.6)                         # a heartbeat tells the coordinator
    reply = c.admin("update_weights", path="tiny:3")
    assert not reply["ok"] and reply["status"] == 409, reply
    pair.admin("abort", rid="f-long")       # its own rid: answered by the follower itself
    assert pair.run("f-long").finish["status_code"] == 499


def test_without_its_coordinator_a_follower_serves_and_refuses_admin_with_503(pair):
    c = pair.c
    c.silent.add("router")
    c.advance(3.0)
    reply = pair.admin("pause", mode="retract")
    assert reply["status"] == 503 and "coordinator" in reply["error"], reply
    assert pair.run(pair.submit("alone")).token_ids == reference(c, PROMPT, 8)


def test_a_command_passed_on_to_a_coordinator_that_then_dies_is_answered_504(pair):
    c = pair.c
    c.silent.add("router")                  # alive a moment ago: the follower passes it on
    pair.client.send(Admin("pause", {"mode": "retract", "timeout": 1.0}, "lost"))
    c.pump(3)
    assert "lost" not in pair.replies and pair.follower.coordinator.passed
    c.advance(3.5)                          # its timeout + --peer-timeout
    assert pair.replies["lost"]["status"] == 504, pair.replies["lost"]
    assert not pair.follower.coordinator.passed and pair.follower.paused is None


def test_a_silent_follower_is_dropped_and_not_waited_for(pair):
    c = pair.c
    pair.follower_silent = True
    c.advance(3.0)
    assert c.admin("status")["followers"] == []
    reply = c.admin("pause", mode="retract")
    assert reply["ok"] and reply["followers"] == [], reply
    assert c.admin("continue")["ok"]


def test_a_forged_follow_is_refused():
    c = InprocCluster()
    try:
        c.client.send(Admin("follow", {"endpoint": "inproc://x", "inflight": 10**9}, "x"))
        c.until(lambda: "x" in c.replies)        # a client is no router (issue 43, item 7)
        assert c.replies["x"]["status"] == 403 and c.admin("status")["followers"] == []
        c.client.send(AdminReply("peers-1", True, {"inflight": 10**9}))   # unasked: dropped
        c.pump()
        assert c.router.running() == 0
    finally:
        c.close()


def test_a_coordinator_frozen_in_a_pause_strands_nothing_at_the_follower(pair):
    """Issue 43: the coordinator is SIGSTOPped (its loop no longer turns) while the pool
    is paused. What waits at the follower, and what comes there meanwhile, ends 503
    naming the coordinator within --peer-timeout and a heartbeat, not never; once the
    coordinator is back, continue runs both routers again."""
    c = pair.c
    assert c.admin("pause", mode="retract")["ok"]
    c.advance(0.6)
    assert pair.follower.holding
    waiting = pair.submit("f-waits")
    c.pump(5)
    assert waiting not in pair.answers and waiting in pair.follower.queued
    c.silent.add("router")
    c.advance(2.6)                         # --peer-timeout (2 s) and a heartbeat
    late = pair.submit("f-late")
    c.advance(0.6)
    for rid in (waiting, late):
        got = pair.answers[rid].finish
        assert got["status_code"] == 503 and "coordinator" in got["message"], got
        assert got["retry_after"] > 0
    assert pair.admin("continue")["status"] == 503
    c.silent.discard("router")
    c.advance(0.6)
    assert c.admin("continue")["ok"]
    c.advance(0.6)
    assert not pair.follower.holding
    assert pair.run(pair.submit("f-after")).token_ids == reference(c, PROMPT, 8)


def test_a_follower_that_disagrees_with_its_coordinator_mends_within_a_heartbeat(pair):
    """Issue 43: a follower that missed a word (it holds while the pool runs, or routes
    while the pool is paused) takes the coordinator's state from the next answer to its
    heartbeat: nothing waits for ever, nothing runs on paused workers for long."""
    c = pair.c
    pair.follower.hold(PauseMode.RETRACT)           # as if it missed the continue
    rid = pair.submit("f-held")
    c.pump(3)
    assert rid in pair.follower.queued
    c.advance(0.6)
    assert pair.follower.paused is None
    assert pair.run(rid).token_ids == reference(c, PROMPT, 8)
    assert c.admin("pause", mode="in_place")["ok"]
    pair.follower.paused = None                     # as if it missed the pause
    c.advance(0.6)
    assert pair.follower.paused is PauseMode.IN_PLACE and pair.follower.holding
    assert c.admin("continue")["ok"]
    c.advance(0.6)
    assert not pair.follower.holding


def test_released_memory_holds_the_follower_until_resume(pair):
    """release_memory through the follower (its coordinator runs it) holds new requests
    at both routers; resume_memory lets both run."""
    c = pair.c
    assert pair.admin("release_memory")["ok"]
    c.pump()
    assert pair.follower.holding and pair.follower.memory_released and pair.follower.paused is None
    rid, mine = pair.submit("f-mem"), c.submit(PROMPT, 8)
    c.pump()
    assert list(pair.follower.queued) == [rid] and list(c.router.queued) == [mine]
    assert pair.admin("resume_memory")["ok"]
    want = reference(c, PROMPT, 8)
    assert pair.run(rid).token_ids == c.run(mine).token_ids == want
    c.check_pages()
