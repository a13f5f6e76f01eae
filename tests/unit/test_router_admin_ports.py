"""RouterAdmin alone, on fakes of its ports (zpd/router/admin.py `Router`): no sockets,
no RouterServer. Each command fans out to the workers it names and folds their
WorkerReply records into one answer."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable

import pytest

from zpd.config import RouterConfig
from zpd.router.admin import RouterAdmin
from zpd.router.flights import InFlight, Worker
from zpd.router.hooks import Alone
from zpd.router.memory import ReleasedMemory
from zpd.router.tally import Tally
from zpd.wire.admin_fields import PauseMode
from zpd.wire.admin_reply import (Continued, Flushed, StagedPush, WeightVersion, WorkerReply,
                                  WorkerStatus)
from zpd.wire.liveness import PeerClock
from zpd.wire.protocol import Abort, Admin, AdminReply, Message


@dataclass
class FakeDealer:
    sent: list[Message] = field(default_factory=list)

    def send(self, msg: Message) -> bool:
        self.sent.append(msg)
        return True


@dataclass
class FakeTimer:
    when: float
    fn: Callable[..., Any]
    args: tuple
    cancelled: bool = False

    def cancel(self) -> None:
        self.cancelled = True


@dataclass
class FakeLoop:
    now: float = 0.0
    timers: list[FakeTimer] = field(default_factory=list)

    def time(self) -> float:
        return self.now

    def call_later(self, delay: float, fn: Callable[..., Any], *args: Any) -> FakeTimer:
        self.timers.append(FakeTimer(self.now + delay, fn, args))
        return self.timers[-1]

    def advance(self, seconds: float) -> None:
        """Move the clock on; run the timers due, not cancelled."""
        self.now += seconds
        due = [t for t in self.timers if t.when <= self.now and not t.cancelled]
        self.timers = [t for t in self.timers if t not in due]
        for t in due:
            t.fn(*t.args)


@dataclass
class FakeFront:
    sent: list[tuple[bytes, Message]] = field(default_factory=list)

    def send(self, identity: bytes, msg: Message) -> bool:
        self.sent.append((identity, msg))
        return True


@dataclass
class FakeRouter:
    """The `Router` port: its state as plain fields, its actions recorded."""
    workers: list[Worker]
    cfg: RouterConfig = RouterConfig(("p:1",), ("d:1",), admin_timeout_s=5.0)
    endpoint: str = "r:1"
    front: FakeFront = field(default_factory=FakeFront)
    loop: FakeLoop = field(default_factory=FakeLoop)
    tally: Tally = field(default_factory=Tally)
    inflight: dict[str, InFlight] = field(default_factory=dict)
    paused: PauseMode | None = None
    released: ReleasedMemory = field(default_factory=ReleasedMemory)
    followers: Alone = field(default_factory=Alone)
    coordinator: None = None
    queued: list[str] = field(default_factory=list)
    aborted: list[Abort] = field(default_factory=list)
    unpaused: int = 0
    dispatched: int = 0

    def running(self) -> int:
        return len(self.inflight)

    def hold(self, mode: PauseMode) -> None:
        self.paused = mode

    def unpause(self) -> None:
        self.paused, self.unpaused = None, self.unpaused + 1

    def dispatch(self) -> None:
        self.dispatched += 1

    def end_queued(self, rid: str, status: int, reason: str) -> None:
        self.queued.remove(rid)

    def on_abort(self, msg: Abort) -> None:
        self.aborted.append(msg)


def worker(role: str, endpoint: str) -> Worker:
    return Worker(role, endpoint, FakeDealer(), PeerClock(0.0))


@pytest.fixture
def router() -> FakeRouter:
    return FakeRouter([worker("prefill", "p:1"), worker("prefill", "p:2"), worker("decode", "d:1")])


def ask(admin: RouterAdmin, command: str, req_id: str = "q", **args: Any) -> None:
    admin.on_admin(b"client", Admin(command, args, req_id))


def answer(admin: RouterAdmin, w: Worker, ok: bool = True, **result: Any) -> None:
    """`w` replies to the last admin command it was sent."""
    admin.on_reply(w, AdminReply(w.dealer.sent[-1].req_id, ok, result))


STATUS = WorkerStatus(weight_version="v1", paused=None, memory="resident",
                      weights_memory="resident", device="cpu", dtype="float32",
                      context_length=64, max_batch=4, kv_pages={"total": 8, "free": 8},
                      tp_size=1, tp_pids=[], loop_max_late_ms=0.5,
                      more={"queues": {"waiting": 0}, "peers": 1})


def status(**changes: Any) -> dict:
    """A worker's status on the wire, with `changes`."""
    return replace(STATUS, **changes).to_wire()


def reply_to_client(router: FakeRouter) -> AdminReply:
    (identity, msg), = router.front.sent
    assert identity == b"client" and isinstance(msg, AdminReply)
    return msg


def test_pause_fans_out_to_the_decodes_then_the_prefills_and_folds_their_replies(router) -> None:
    admin = RouterAdmin(router)
    prefills, decode = router.workers[:2], router.workers[2]
    ask(admin, "pause", mode="abort")
    assert router.paused is PauseMode.ABORT
    assert [m.command for m in decode.dealer.sent] == ["pause"]
    assert all(not p.dealer.sent for p in prefills)          # decodes first
    answer(admin, decode, **status(paused="abort"))
    assert [m.args for p in prefills for m in p.dealer.sent] == [{"mode": "abort"}] * 2
    assert not router.front.sent
    for p in prefills:
        answer(admin, p, **status(paused="abort"))
    reply = reply_to_client(router)
    assert reply.req_id == "q" and reply.ok
    assert [(w["endpoint"], w["role"], w["paused"]) for w in reply.result["workers"]] == [
        ("p:1", "prefill", "abort"), ("p:2", "prefill", "abort"), ("d:1", "decode", "abort")]
    assert reply.result["paused"] is PauseMode.ABORT and not admin.fanouts


def test_a_failing_worker_makes_the_answer_not_ok_and_says_why(router) -> None:
    admin = RouterAdmin(router)
    ask(admin, "flush_cache")
    assert all(w.dealer.sent[-1].command == "flush_cache" for w in router.workers)
    answer(admin, router.workers[0], flushed_pages=0)
    answer(admin, router.workers[1], ok=False, status=409, error="requests in flight")
    answer(admin, router.workers[2], flushed_pages=3)
    reply = reply_to_client(router)
    assert not reply.ok
    failed = [w for w in reply.result["workers"] if not w["ok"]]
    assert failed == [{"ok": False, "status": 409, "error": "requests in flight",
                       "endpoint": "p:2", "role": "prefill"}]


def test_a_reply_from_a_worker_not_asked_is_refused(router) -> None:
    admin = RouterAdmin(router)
    ask(admin, "status")
    key = router.workers[0].dealer.sent[-1].req_id
    stranger = worker("decode", "x:9")
    admin.on_reply(stranger, AdminReply(key, True, {}))             # not one of the targets
    admin.on_reply(router.workers[0], AdminReply("no-such-key", True, {}))
    (fan,) = admin.fanouts.values()
    assert fan.waiting == {"p:1", "p:2", "d:1"} and not fan.replies
    answer(admin, router.workers[0], ok=False, status=500, error="broken")
    answer(admin, router.workers[0])                                # a second reply: ignored
    assert fan.waiting == {"p:2", "d:1"} and [r.ok for r in fan.replies] == [False]


def test_dead_and_silent_workers_answer_503_and_504(router) -> None:
    admin = RouterAdmin(router)
    router.workers[1].alive = False
    ask(admin, "flush_cache", timeout=2.0)
    assert not router.workers[1].dealer.sent                        # never sent to the dead
    answer(admin, router.workers[0], flushed_pages=0)
    router.loop.advance(2.0)
    reply = reply_to_client(router)
    statuses = {w["endpoint"]: (w["ok"], w.get("status")) for w in reply.result["workers"]}
    assert statuses == {"p:1": (True, None), "p:2": (False, 503), "d:1": (False, 504)}
    assert not reply.ok and not admin.fanouts


def test_continue_unpauses_once_the_decodes_and_a_prefill_continued(router) -> None:
    admin = RouterAdmin(router)
    router.paused = PauseMode.RETRACT
    ask(admin, "continue")
    prefills, decode = router.workers[:2], router.workers[2]
    answer(admin, prefills[0], **status(), was_paused="retract")
    answer(admin, prefills[1], ok=False, status=503, error="gone")
    sent = decode.dealer.sent[-1]
    assert sent.command == "continue" and sent.args["prefills"] == ["p:1"]  # the live ones
    answer(admin, decode, **status(), was_paused="retract", resumed=2)
    assert reply_to_client(router).ok and router.unpaused == 1 and router.paused is None


def test_bad_input_is_answered_400_and_sends_nothing(router) -> None:
    admin = RouterAdmin(router)
    ask(admin, "no_such_command")
    ask(admin, "pause", req_id="q2", mode="sideways")
    replies = [m for _, m in router.front.sent]
    assert [(r.req_id, r.ok, r.result["status"]) for r in replies] == [("q", False, 400),
                                                                        ("q2", False, 400)]
    assert router.paused is None and not any(w.dealer.sent for w in router.workers)


def test_a_worker_reply_keeps_its_json_and_takes_the_router_s_envelope() -> None:
    wire = {"status": 409, "error": "busy", "endpoint": "forged"}
    got = WorkerReply.from_wire(False, wire, "d:1", "decode", WeightVersion)
    assert (got.status, got.error, got.result) == (409, "busy", None)
    assert got.to_wire() == {"ok": False, "status": 409, "error": "busy",
                             "endpoint": "d:1", "role": "decode"}
    ok = WorkerReply.from_wire(True, {"weight_version": "v2", "role": "forged"}, "p:1",
                               "prefill", WeightVersion)
    assert ok.result == WeightVersion("v2")
    assert ok.to_wire() == {"ok": True, "weight_version": "v2", "endpoint": "p:1",
                            "role": "prefill"}


def test_a_status_keeps_every_field_the_worker_sent_in_its_order() -> None:
    wire = status(paused="retract")
    got = WorkerReply.from_wire(True, wire, "d:1", "decode", WorkerStatus)
    assert got.result.paused == "retract" and got.result.more == STATUS.more
    assert list(got.to_wire().items()) == list(({"ok": True} | wire
                                                | {"endpoint": "d:1", "role": "decode"}).items())


def test_a_continue_answer_names_what_it_resumed_only_on_a_decode() -> None:
    decode = Continued.from_wire(status() | {"was_paused": "retract", "resumed": 2})
    prefill = Continued.from_wire(status() | {"was_paused": None})
    assert (decode.status, decode.was_paused, decode.resumed) == (STATUS, "retract", 2)
    assert prefill.to_wire() == status() | {"was_paused": None}
    assert "resumed" not in prefill.to_wire() and decode.to_wire()["resumed"] == 2


@pytest.mark.parametrize("ok, wire, kind, why", [
    (True, {"flushed_pages": "3"}, Flushed, "'flushed_pages' must be int, not '3'"),
    (True, {"flushed_pages": True}, Flushed, "'flushed_pages' must be int, not True"),
    (True, {}, Flushed, "missing 'flushed_pages'"),
    (True, {"staged_tensors": 1, "staged_bytes": 8, "extra": 1}, StagedPush,
     "unexpected 'extra'"),
    (True, status() | {"paused": 3}, WorkerStatus, "'paused' must be str or null, not 3"),
    (True, status(), Continued, "missing 'was_paused'"),
    (False, {"status": "409", "error": "busy"}, Flushed, "'status' must be int"),
    (False, {"error": "busy"}, Flushed, "missing 'status'"),
])
def test_a_malformed_result_becomes_a_failed_reply_that_says_why(ok, wire, kind, why) -> None:
    got = WorkerReply.from_wire(ok, wire, "p:1", "prefill", kind)
    assert (got.ok, got.status, got.result) == (False, 500, None)
    assert got.error.startswith("malformed reply from the worker: ") and why in got.error


def test_the_router_answers_a_malformed_worker_result_as_that_worker_failing(router) -> None:
    admin = RouterAdmin(router)
    ask(admin, "flush_cache")
    answer(admin, router.workers[0], flushed_pages=1)
    answer(admin, router.workers[1], flushed_pages=[1])
    answer(admin, router.workers[2], flushed_pages=2)
    reply = reply_to_client(router)
    assert not reply.ok and not admin.fanouts and not admin.results
    (bad,) = [w for w in reply.result["workers"] if not w["ok"]]
    assert (bad["endpoint"], bad["status"]) == ("p:2", 500)
    assert "Flushed: 'flushed_pages' must be int, not [1]" in bad["error"]
    assert [w.get("flushed_pages") for w in reply.result["workers"]] == [1, None, 2]


def test_release_and_resume_memory_set_what_the_router_holds_for(router):
    """Each worker's reply says what it released; the router holds new requests while
    any is (zpd/router/memory.py), and says so in every admin answer."""
    admin = RouterAdmin(router)
    ask(admin, "release_memory", tags=["kv_cache"])
    for w in router.workers:
        answer(admin, w, memory="released", weights_memory="resident")
    assert reply_to_client(router).ok and set(router.released.workers) == {"p:1", "p:2", "d:1"}
    assert router.dispatched == 1
    assert router.released.workers["d:1"] == ("kv_cache",)
    router.front.sent.clear()
    ask(admin, "resume_memory", req_id="r")
    answer(admin, router.workers[0], memory="resident", weights_memory="resident")
    answer(admin, router.workers[1], ok=False, status=500, error="could not restore")
    answer(admin, router.workers[2], memory="resident", weights_memory="resident")
    reply = reply_to_client(router)
    assert not reply.ok and list(router.released.workers) == ["p:2"]     # still released there
    assert reply.result["memory_released"] == [{"endpoint": "p:2", "released": ["kv_cache"]}]


def test_status_tells_a_router_that_never_saw_the_release(router):
    """A restarted router learns released memory from the workers' status."""
    admin = RouterAdmin(router)
    ask(admin, "status")
    for w in router.workers:
        answer(admin, w, **status(weights_memory="released" if w.endpoint == "d:1" else "resident"))
    assert router.released.workers == {"d:1": ("weights",)}
    assert reply_to_client(router).result["memory_released"] == [
        {"endpoint": "d:1", "released": ["weights"]}]
