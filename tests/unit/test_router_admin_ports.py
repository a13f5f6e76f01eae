"""RouterAdmin alone, on fakes of its ports (zpd/router/admin.py `Router`): no sockets,
no RouterServer. Each command fans out to the workers it names and folds their
WorkerReply records into one answer."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import pytest

from zpd.config import RouterConfig
from zpd.router.admin import RouterAdmin
from zpd.router.flights import InFlight, Worker
from zpd.router.hooks import Alone
from zpd.router.tally import Tally
from zpd.wire.admin_fields import PauseMode
from zpd.wire.admin_reply import WorkerReply
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
    followers: Alone = field(default_factory=Alone)
    coordinator: None = None
    queued: list[str] = field(default_factory=list)
    aborted: list[Abort] = field(default_factory=list)
    unpaused: int = 0

    def running(self) -> int:
        return len(self.inflight)

    def hold(self, mode: PauseMode) -> None:
        self.paused = mode

    def unpause(self) -> None:
        self.paused, self.unpaused = None, self.unpaused + 1

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
    answer(admin, decode, paused="abort")
    assert [m.args for p in prefills for m in p.dealer.sent] == [{"mode": "abort"}] * 2
    assert not router.front.sent
    for p in prefills:
        answer(admin, p, paused="abort")
    reply = reply_to_client(router)
    assert reply.req_id == "q" and reply.ok
    assert [(w["endpoint"], w["role"], w["paused"]) for w in reply.result["workers"]] == [
        ("p:1", "prefill", "abort"), ("p:2", "prefill", "abort"), ("d:1", "decode", "abort")]
    assert reply.result["paused"] is PauseMode.ABORT and not admin.fanouts


def test_a_failing_worker_makes_the_answer_not_ok_and_says_why(router) -> None:
    admin = RouterAdmin(router)
    ask(admin, "flush_cache")
    assert all(w.dealer.sent[-1].command == "flush_cache" for w in router.workers)
    answer(admin, router.workers[0])
    answer(admin, router.workers[1], ok=False, status=409, error="requests in flight")
    answer(admin, router.workers[2])
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
    answer(admin, router.workers[0])
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
    answer(admin, prefills[0])
    answer(admin, prefills[1], ok=False, status=503, error="gone")
    sent = decode.dealer.sent[-1]
    assert sent.command == "continue" and sent.args["prefills"] == ["p:1"]  # the live ones
    answer(admin, decode)
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
    wire = {"status": 409, "error": "busy", "weight_version": "v2", "endpoint": "forged"}
    got = WorkerReply.from_wire(False, wire, "d:1", "decode")
    assert (got.status, got.error, got.result) == (409, "busy", {"weight_version": "v2"})
    assert got.to_wire() == {"ok": False, "status": 409, "error": "busy",
                             "weight_version": "v2", "endpoint": "d:1", "role": "decode"}
    odd = WorkerReply.from_wire(True, {"status": "fine"}, "p:1", "prefill")
    assert odd.status is None and odd.to_wire()["status"] == "fine"
