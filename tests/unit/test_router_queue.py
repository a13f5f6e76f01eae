"""The router queues load instead of refusing it (issue 30): past a client's share or
--max-concurrent-requests a request waits its fair turn; it is refused only past
--queue-size (429) or --queue-timeout (503), both with a retry_after; a waiting
request stays abortable, ends with its client, with pause(abort), and when no worker
is left; every charge comes back. Cluster scenarios in one process (inproc.py)."""
from __future__ import annotations

from dataclasses import replace

import pytest

from engines.sampling_params import SamplingParams
from tests.unit.inproc import InprocCluster, reference
from zpd.wire.admin_fields import SyncStep
from zpd.wire.net import Dealer
from zpd.wire.protocol import Generate, Tokens

PROMPT = [5, 17, 99, 3, 42, 7, 250, 1, 64, 31, 8, 200, 13, 77, 150, 9, 21]
GREEDY = SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True)


@pytest.fixture
def narrow():
    """A router that routes one request at a time."""
    c = InprocCluster(router_args={"max_concurrent_requests": 1})
    yield c
    c.close()


def settled(c: InprocCluster) -> None:
    """Nothing waits, nothing is routed, nothing is charged, every page is back."""
    c.pump()
    assert len(c.router.queued) == 0 and not c.router.admission.tree.children
    assert not c.router.inflight and c.router.shares.held == {}
    c.check_pages()


def send(c: InprocCluster, rid: str, user: str = "", max_new: int = 4, **fields) -> str:
    c.client.send(Generate(rid, PROMPT, replace(GREEDY, max_new_tokens=max_new), True,
                           user=user, **fields))
    return rid


def ends(dealer: Dealer, c: InprocCluster, rids: set[str]) -> dict[str, dict]:
    """Pump until every rid of `rids` ended at `dealer` (another client than c's)."""
    got: dict[str, dict] = {}
    for _ in range(600):
        c.pump(1)
        while (msg := dealer.recv()) is not None:
            for part in msg.unpack() if isinstance(msg, Tokens) else []:
                if part.finished:
                    got[part.rid] = part.finish
        if rids <= set(got):
            return got
    raise AssertionError(f"no end for {rids - set(got)}")


@pytest.mark.parametrize("limits", [{"max_client_requests": 3},
                                    {"max_client_tokens": 3 * (len(PROMPT) + 4)}])
def test_a_client_past_its_share_waits_and_another_client_goes_first(limits):
    c = InprocCluster(router_args=limits)
    other = Dealer(c.ctx, c.router.endpoint, identity=b"other")
    try:
        mine = [c.submit(PROMPT, 4) for _ in range(5)]
        c.pump(1)
        assert len(c.router.inflight) == 3 and list(c.router.queued) == mine[3:]
        assert not any(c.finished(r) for r in mine)          # waiting, not refused
        other.send(Generate("theirs", PROMPT, GREEDY))
        c.pump(1)
        assert "theirs" in c.router.inflight                  # its share is its own
        assert ends(other, c, {"theirs"})["theirs"]["type"] == "length"
        for rid in mine:
            assert c.run(rid).token_ids == reference(c, PROMPT, 4)
        settled(c)
    finally:
        other.close()
        c.close()


def test_at_most_max_concurrent_requests_are_routed_and_all_finish():
    c = InprocCluster(router_args={"max_concurrent_requests": 2})
    try:
        rids = [c.submit(PROMPT[i:], 5) for i in range(7)]
        worst = 0
        for _ in range(800):
            c.pump(1)
            worst = max(worst, len(c.router.inflight))
            if all(c.finished(r) for r in rids):
                break
        assert worst == 2
        for i, rid in enumerate(rids):
            assert c.answers[rid].token_ids == reference(c, PROMPT[i:], 5)
        settled(c)
    finally:
        c.close()


def test_a_users_request_passes_another_users_flood_on_the_same_connection(narrow):
    """Issue 30 item 5: one HTTP call of 1,024 generations no longer takes the front's
    whole quota: the front names each caller, and the router takes turns among them."""
    c = narrow
    flood = [send(c, f"flood{i}", user="alice", max_new=3) for i in range(6)]
    bob = send(c, "bob", user="bob", max_new=3)
    order = []
    for _ in range(800):
        c.pump(1)
        order += [r for r in flood + [bob] if c.finished(r) and r not in order]
        if len(order) == 7:
            break
    assert order[:2] == ["flood0", "bob"], order             # the next free slot is bob's
    assert all(c.answers[r].finish["type"] == "length" for r in order)
    settled(c)


def test_queue_full_is_429_with_retry_after_and_changes_nothing_else():
    c = InprocCluster(router_args={"max_concurrent_requests": 1, "queue_size": 2})
    try:
        rids = [c.submit(PROMPT, 4) for _ in range(3)]       # one routed, two wait
        over = c.submit(PROMPT, 4)
        c.pump(1)
        got = c.answers[over]
        assert got.status == 429 and got.finish["message"].startswith("queue full")
        assert "--queue-size 2" in got.finish["message"] and got.finish["retry_after"] > 0
        assert got.meta["completion_tokens"] == 0
        for rid in rids:
            assert c.run(rid).finish["type"] == "length"
        settled(c)
    finally:
        c.close()


def test_queue_timeout_is_503_on_the_routers_clock():
    c = InprocCluster(router_args={"max_concurrent_requests": 1, "queue_timeout": 5.0})
    try:
        first = c.submit(PROMPT, 200)            # holds the one slot past the timeout
        late = c.submit(PROMPT, 4)
        c.pump(2)
        assert late in c.router.queued
        c.advance(4.5)
        assert late in c.router.queued and not c.finished(late)
        c.advance(1.0)
        got = c.answers[late]
        assert got.status == 503 and got.finish["message"].startswith("queue timeout")
        assert "--queue-timeout 5" in got.finish["message"] and got.finish["retry_after"] > 0
        assert late not in c.router.queued and not c.finished(first)
        assert c.run(first, 2000).finish["type"] == "length"
        settled(c)
    finally:
        c.close()


def test_a_pause_longer_than_the_queue_timeout_fails_nothing_that_waits():
    c = InprocCluster(router_args={"max_concurrent_requests": 1, "queue_timeout": 5.0})
    try:
        assert c.admin("pause", mode="in_place")["ok"]
        rids = [c.submit(PROMPT, 4) for _ in range(2)]
        c.pump(2)
        c.advance(30.0)                                  # a long update from disk
        assert list(c.router.queued) == rids and not any(map(c.finished, rids))
        assert c.admin("continue")["ok"]
        for rid in rids:
            assert c.run(rid).finish["type"] == "length"
        settled(c)
    finally:
        c.close()


def test_a_waiting_request_is_abortable_and_its_rid_taken(narrow):
    c = narrow
    first = c.submit(PROMPT, 30)
    waiting = c.submit(PROMPT, 4)
    c.pump(1)
    assert waiting in c.router.queued
    again = send(c, waiting)                                   # same rid while it waits
    c.pump(1)
    assert c.answers[again].status == 409
    c.abort(waiting)
    c.pump(1)
    assert c.answers[waiting].status == 499 and waiting not in c.router.queued
    assert c.run(first).finish["type"] == "length"
    settled(c)


def test_a_bad_user_name_is_400():
    c = InprocCluster()
    try:
        c.silent |= {"prefill", "decode"}
        send(c, "long", user="u" * 129)
        send(c, "ctl", user="a\nb")
        c.pump(2)
        for rid in ("long", "ctl"):
            assert c.answers[rid].status == 400 and "user must be" in c.answers[rid].finish["message"]
        assert not c.router.inflight and len(c.router.queued) == 0
    finally:
        c.close()


def test_waiting_requests_end_when_their_client_hangs_up(narrow):
    c = narrow
    gone = Dealer(c.ctx, c.router.endpoint, identity=b"gone")
    first = c.submit(PROMPT, 30)
    for i in range(3):
        gone.send(Generate(f"g{i}", PROMPT, GREEDY))
    c.pump(2)
    assert c.router.admission.of_client(b"gone") == ["g0", "g1", "g2"]
    gone.close()
    c.router.client_gone(b"gone")          # what a failed ping finds (test_limits covers that)
    assert c.router.admission.clients() == set()
    assert c.run(first).finish["type"] == "length"
    settled(c)


def test_pause_holds_the_queue_continue_routes_it_pause_abort_ends_it(narrow):
    c = narrow
    assert c.admin("pause", mode="in_place")["ok"]
    rids = [c.submit(PROMPT, 4) for _ in range(3)]
    c.pump(2)
    assert list(c.router.queued) == rids and not c.router.inflight
    assert c.admin("continue")["ok"]
    c.pump(1)
    assert len(c.router.inflight) == 1                     # the cap holds after continue too
    for rid in rids:
        assert c.run(rid).finish["type"] == "length"
    running = c.submit(PROMPT, 40)
    waiting = [c.submit(PROMPT, 4) for _ in range(2)]
    c.until(lambda: c.answers.get(running) and c.answers[running].token_ids)
    assert c.admin("pause", mode="abort")["ok"]
    for rid in [running, *waiting]:
        assert c.run(rid).status == 499
    assert c.admin("continue")["ok"]
    settled(c)


def test_a_dead_decode_fails_what_runs_and_what_waits_then_all_is_back(narrow):
    c = narrow
    c.silent.add("decode")
    rids = [c.submit(PROMPT, 4) for _ in range(3)]
    c.pump(2)
    assert len(c.router.queued) == 2
    c.advance(3.0)                                           # past --peer-timeout
    for rid in rids:
        assert c.answers[rid].status == 503
    assert len(c.router.queued) == 0 and c.router.shares.held == {}
    c.silent.clear()
    c.advance(1.0)                                           # it answers again
    c.serves_again()
    settled(c)


def test_requests_wait_through_a_weight_push_and_run_after_it(narrow):
    """While a push is under way (zpd/router/weights/sync.py sets its `step`, then
    calls unpause) nothing new is routed; after it, the queue runs, one at a time."""
    c = narrow
    c.router.admin.sync.step = SyncStep.PUSHING
    rids = [c.submit(PROMPT, 4) for _ in range(2)]
    c.pump(2)
    assert list(c.router.queued) == rids and not c.router.inflight
    c.router.admin.sync.step = None
    c.router.unpause()
    assert len(c.router.inflight) == 1
    for rid in rids:
        assert c.run(rid).finish["type"] == "length"
    settled(c)
