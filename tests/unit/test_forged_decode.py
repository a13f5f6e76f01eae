"""Forged messages to a decode (issue #11, finding 5), on the in-process cluster
(tests/unit/inproc.py): a generate naming a prefill that is no endpoint, a prefill
whose kv_done carries a token outside the vocabulary, a kv_done from a prefill the
request never asked, a continue naming bad prefills, a handler that raises. Each
time the decode answers or drops the message, keeps its pages and keeps serving."""
from __future__ import annotations

import logging


from engines.sampling_params import SamplingParams
from tests.unit.inproc import InprocCluster, reference
from zpd.wire.router_proof import load_router_secret, router_identity
from zpd.wire.net import Dealer, Router
from zpd.wire.protocol import (Abort, Admin, AdminReply, Generate, Hello, HelloAck, KvDest,
                               KvDone, KvFailed, Ping, Pong, Tokens)
from zpd.worker.decode import DecodePhase

PROMPT = [5, 17, 99, 3, 42, 7, 250, 1, 64, 31, 8, 200, 13, 77, 150, 9, 21]
SAMPLING = SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True)


class FakePrefill:
    """A 'prefill' the decode dials: it says hello back, answers pings, and keeps
    every other message for the test, which sends whatever it likes."""

    def __init__(self, c: InprocCluster, name: str) -> None:
        self.sock = Router(c.ctx, f"inproc://{name}", 0)
        self.endpoint = self.sock.endpoint
        self.decode: bytes | None = None
        self.got: list = []

    def read(self) -> None:
        while (got := self.sock.recv()) is not None:
            self.decode, msg = got
            if isinstance(msg, Ping):
                self.sock.send(self.decode, Pong(msg.seq, msg.sent_at, self.endpoint))
            elif isinstance(msg, Hello):
                self.sock.send(self.decode, HelloAck(True, msg.layout, msg.compat_hash, "fake",
                                                     [], msg.num_pages, "tiny"))
            else:
                self.got.append(msg)

    def send(self, msg) -> None:
        self.sock.send(self.decode, msg)

    def dest(self, room: int) -> KvDest | None:
        return next((m for m in self.got if isinstance(m, KvDest) and m.room == room), None)


class Forger:
    """A raw client of the decode's own socket in the router's place (with the router
    secret: a worker that holds one takes requests only from its routers)."""

    def __init__(self, c: InprocCluster) -> None:
        identity = router_identity("inproc://forger", "1.2", load_router_secret(c.secret_file))
        self.dealer = Dealer(c.ctx, c.decode.endpoint, identity=identity)
        self.finish: dict[str, dict] = {}
        self.replies: list[dict] = []

    def read(self) -> None:
        while (msg := self.dealer.recv()) is not None:
            if isinstance(msg, AdminReply):
                self.replies.append({"ok": msg.ok} | msg.result)
            for part in msg.unpack() if isinstance(msg, Tokens) else []:
                if part.finished:
                    self.finish[part.rid] = part.finish

    def generate(self, rid: str, room: int, prefill: str) -> None:
        self.dealer.send(Generate(rid, PROMPT, SAMPLING, False, room, 0, prefill, ""))


def turn(c: InprocCluster, *peers, rounds: int = 20) -> None:
    for _ in range(rounds):
        c.pump(1)
        for peer in peers:
            peer.read()


def test_generate_naming_no_endpoint_is_refused_without_a_socket(cluster):
    forger = Forger(cluster)
    bad = ["not-an-endpoint", "", "host:0", "host:65536", ":5555", "host:12a", "ho st:5555",
           "tcp://host", "inproc://"]
    for i, endpoint in enumerate(bad):
        forger.generate(f"f{i}", 100 + i, endpoint)
    turn(cluster, forger)
    for i, endpoint in enumerate(bad):
        finish = forger.finish[f"f{i}"]
        assert finish["status_code"] == 400 and "prefill" in finish["message"], (endpoint, finish)
    assert cluster.decode.scheduler.links.links.keys() <= {cluster.prefill.endpoint}
    assert not cluster.decode.scheduler.jobs
    cluster.serves_again()


def test_first_token_outside_the_vocabulary_fails_the_request_not_the_decode(cluster):
    fake, forger = FakePrefill(cluster, "fake-p"), Forger(cluster)
    forger.generate("big", 7, fake.endpoint)
    turn(cluster, fake, forger)
    assert fake.dest(7) is not None
    fake.send(KvDone(7, 0, 1_000_000, "tiny"))
    turn(cluster, fake, forger)
    finish = forger.finish["big"]
    assert finish["status_code"] == 500 and "1000000" in finish["message"], finish
    told = [m for m in fake.got if isinstance(m, KvFailed) and m.room == 7]
    assert told and told[0].status == 500              # the prefill hears of it
    cluster.check_pages()                              # kv_done said the write is over
    cluster.serves_again()


def test_kv_done_counts_only_from_the_prefill_the_request_asked(cluster):
    asked, other, forger = FakePrefill(cluster, "fake-a"), FakePrefill(cluster, "fake-b"), \
        Forger(cluster)
    forger.generate("mine", 11, asked.endpoint)
    forger.generate("theirs", 12, other.endpoint)
    turn(cluster, asked, other, forger)
    assert asked.dest(11) and other.dest(12)
    other.send(KvDone(11, 0, 5, "tiny"))               # not its request
    turn(cluster, asked, other, forger)
    assert cluster.decode.scheduler.jobs[11].phase is DecodePhase.TRANSFERRING
    asked.send(KvFailed(11, 0, 500, "gave up"))
    other.send(KvFailed(12, 0, 500, "gave up"))
    turn(cluster, asked, other, forger)
    assert forger.finish["mine"]["status_code"] == 500
    assert "fake-a" in forger.finish["mine"]["message"]
    cluster.check_pages()
    cluster.serves_again()


def test_continue_naming_bad_prefills_keeps_the_request_own_prefill(cluster):
    rid = cluster.submit(PROMPT, 30)
    cluster.until(lambda: DecodePhase.RUNNING in
                  [j.phase for j in cluster.decode.scheduler.jobs.values()])
    assert cluster.admin("pause", mode="retract")["ok"]
    prefill_admin = Dealer(cluster.ctx, cluster.prefill.endpoint, identity=b"admin-p")
    decode_admin = Forger(cluster)
    prefill_admin.send(Admin("continue", {}, "c1"))
    cluster.pump()
    decode_admin.dealer.send(Admin("continue", {"prefills": ["not-an-endpoint", "host:0"]}, "c2"))
    turn(cluster, decode_admin)
    assert decode_admin.replies and decode_admin.replies[0]["ok"]
    assert cluster.admin("continue")["ok"]             # the router's own state
    got = cluster.run(rid)
    assert got.token_ids == reference(cluster, PROMPT, 30) and got.meta["retractions"] == 1
    assert "not-an-endpoint" not in cluster.decode.scheduler.links.links
    cluster.pump()
    cluster.check_pages()
    prefill_admin.close()


def test_a_handler_that_raises_is_logged_and_its_message_dropped(cluster, monkeypatch, caplog):
    """The last line of defence: whatever a handler missed must not end the loop."""
    def broken(identity, msg):
        raise KeyError("a bug")
    monkeypatch.setitem(cluster.decode.handlers, Abort, broken)
    with caplog.at_level(logging.ERROR, logger="zpd.worker.core"):
        cluster.decode._dispatch(b"someone", Abort("r", 499, "x"))
        forger = Forger(cluster)
        forger.dealer.send(Abort("r", 499, "x"))
        turn(cluster, forger)
    logged = [r for r in caplog.records if r.name == "zpd.worker.core"]
    assert logged and "abort" in logged[0].getMessage() and "someone" in logged[0].getMessage()
    assert logged[0].exc_info is not None
    cluster.serves_again()


def test_kv_done_claiming_more_cached_tokens_than_the_prompt_fails_the_request(cluster):
    fake, forger = FakePrefill(cluster, "fake-c"), Forger(cluster)
    forger.generate("cached", 9, fake.endpoint)
    turn(cluster, fake, forger)
    assert fake.dest(9) is not None
    fake.send(KvDone(9, 0, 5, "tiny", cached_tokens=len(PROMPT) + 1))
    turn(cluster, fake, forger)
    finish = forger.finish["cached"]
    assert finish["status_code"] == 500 and "cached_tokens" in finish["message"], finish
    cluster.check_pages()
    cluster.serves_again()
