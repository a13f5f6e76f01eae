"""Long prompts are tokenized off the scheduler thread (zpd/worker/tokenizing.py): the
loop keeps serving other requests and admin commands meanwhile, and an abort, a pause
or a silent router during the tokenizing ends or holds the request as it would have
had it arrived a moment later. The tokenizer is gated by an Event here, so each test
decides when tokenizing ends, whatever the machine's speed."""
from __future__ import annotations

import threading
import time

import pytest

from engines.sampling_params import SamplingParams
from tests.unit.inproc import InprocCluster, reference
from zpd.wire.router_proof import load_router_secret, router_identity
from zpd.wire.net import Dealer
from zpd.wire.protocol import Generate, Tokens
from zpd.worker.tokenizing import LONG_PROMPT_BYTES

PROMPT = [5, 17, 99, 3, 42, 7]          # what the gated tokenizer returns for the long text
LONG_TEXT = "x" * LONG_PROMPT_BYTES
GREEDY = SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True)
WAIT_S = 30.0


@pytest.fixture
def gate(cluster, monkeypatch) -> threading.Event:
    """Both workers' tokenizers wait for this event; they run on a thread of their own."""
    opened = threading.Event()
    threads: set[str] = set()

    def gated(text: str) -> list[int]:
        threads.add(threading.current_thread().name)
        assert opened.wait(WAIT_S), "the test never opened the gate"
        return list(PROMPT)

    for core in (cluster.prefill, cluster.decode):
        monkeypatch.setattr(core.model, "encode", gated)
    opened.threads = threads
    yield opened
    opened.set()


def pending(c: InprocCluster) -> int:
    return len(c.prefill.tokenizing.pending) + len(c.decode.tokenizing.pending)


def pump_until(c: InprocCluster, done, what: str) -> None:
    """Pump until `done()`; real time passes too, for the tokenizing thread."""
    deadline = time.monotonic() + WAIT_S
    while not done():
        assert time.monotonic() < deadline, f"never: {what}"
        c.pump(1)
        time.sleep(0.001)


def start_long(c: InprocCluster, rid: str = "long") -> None:
    c.client.send(Generate(rid, [], GREEDY, text=LONG_TEXT))
    pump_until(c, lambda: pending(c) == 2, "both workers tokenizing")


def test_other_requests_and_status_go_on_while_a_long_text_is_tokenized(cluster, gate):
    start_long(cluster)
    short = cluster.submit(PROMPT, 4)
    assert cluster.run(short).token_ids == reference(cluster, PROMPT, 4)
    status = cluster.admin("status")
    assert status["ok"] and len(status["workers"]) == 2
    assert not cluster.finished("long") and pending(cluster) == 2
    gate.set()
    pump_until(cluster, lambda: cluster.finished("long"), "the long request's answer")
    assert cluster.answers["long"].token_ids == reference(cluster, PROMPT, 4)
    assert gate.threads == {"tokenize_0"}          # never the scheduler's thread
    cluster.check_pages()


def test_a_short_text_is_tokenized_inline(cluster, gate):
    gate.set()
    cluster.client.send(Generate("short", [], GREEDY, text="hello"))
    assert cluster.run("short").token_ids == reference(cluster, PROMPT, 4)
    assert "tokenize_0" not in gate.threads


def test_an_abort_while_tokenizing_ends_it_at_once(cluster, gate):
    start_long(cluster)
    cluster.abort("long")
    pump_until(cluster, lambda: cluster.finished("long"), "the abort's answer")
    assert cluster.answers["long"].status == 499
    gate.set()
    pump_until(cluster, lambda: pending(cluster) == 0, "tokenizing done")
    cluster.pump()
    assert not cluster.decode.scheduler.jobs and not cluster.answers["long"].token_ids
    cluster.serves_again()


@pytest.mark.parametrize("release_while_paused", [True, False])
def test_a_retract_pause_while_tokenizing_holds_then_recomputes(cluster, gate, release_while_paused):
    """Whether tokenizing ends during the pause or after continue, the prefill drops the
    generate (as one arriving during a pause) and the decode has it recomputed."""
    start_long(cluster)
    assert cluster.admin("pause", mode="retract")["ok"]
    if release_while_paused:
        gate.set()
        pump_until(cluster, lambda: pending(cluster) == 0, "tokenizing done")
        assert [j.phase.value for j in cluster.decode.scheduler.jobs.values()] == ["held"]
    assert cluster.admin("continue")["ok"]
    gate.set()
    pump_until(cluster, lambda: cluster.finished("long"), "the long request's answer")
    assert cluster.answers["long"].token_ids == reference(cluster, PROMPT, 4)
    cluster.check_pages()


def test_an_abort_pause_ends_what_is_being_tokenized(cluster, gate):
    start_long(cluster)
    assert cluster.admin("pause", mode="abort")["ok"]
    pump_until(cluster, lambda: cluster.finished("long"), "the abort's answer")
    assert cluster.answers["long"].status == 499
    gate.set()
    pump_until(cluster, lambda: pending(cluster) == 0, "tokenizing done")
    assert cluster.admin("continue")["ok"]
    cluster.pump()
    assert not cluster.decode.scheduler.jobs and not cluster.prefill.scheduler.jobs
    cluster.serves_again()


def test_a_decode_refuses_a_rid_it_is_tokenizing(cluster, gate):
    """(The router refuses a duplicate rid itself; a second router might not.)"""
    start_long(cluster)
    second = router_identity("inproc://router-2", "1.2", load_router_secret(cluster.secret_file))
    other = Dealer(cluster.ctx, cluster.decode.endpoint, identity=second)
    try:
        other.send(Generate("long", [1, 2], GREEDY, room=10_000, prefill=cluster.prefill.endpoint,
                            decode=cluster.decode.endpoint))
        got = None
        for _ in range(1000):
            cluster.pump(1)
            got = other.recv()
            if got is not None:
                break
        assert isinstance(got, Tokens), got
        (part,) = got.unpack()
        assert part.rid == "long" and part.finish["status_code"] == 409
    finally:
        other.close()
    gate.set()
    pump_until(cluster, lambda: cluster.finished("long"), "the first request's answer")
    assert cluster.answers["long"].token_ids == reference(cluster, PROMPT, 4)
    cluster.check_pages()


def test_an_over_long_prompt_is_refused_before_its_ids_are_scanned(cluster):
    """On the loop, after tokenizing: a megabyte's ids took a second to range-check
    before the context length refused them anyway. Lengths are checked first (the ids
    here are all out of range, so the message shows which check answered)."""
    from engines.request import Unservable, validate
    from engines.sampler import SamplingParams
    core = cluster.prefill
    with pytest.raises(Unservable, match="exceeds the context length"):
        validate([-1] * (1 << 20), SamplingParams(), core.model.cfg, core.pool.layout.page_size,
                 core.pool.num_pages)
