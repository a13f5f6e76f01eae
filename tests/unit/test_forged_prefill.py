"""A peer that forges `hello` and `kv_dest` must not control where the prefill writes
(issue #11, finding 2). On the in-process cluster (tests/unit/inproc.py) with a raw
DEALER as the forger: a kv_dest counts only from the decode the router paired the room
with, page ids are checked against the pool that decode announced, a hello with an
impossible pool is refused, and a bad request fails alone while the prefill serves on."""
from __future__ import annotations

import dataclasses

import pytest

import zpd.router.server as router_server
import zpd.worker.decode as decode_module
from tests.unit.inproc import InprocCluster, reference
from zpd.wire.net import Dealer
from zpd.wire.protocol import HelloAck, KvDest, KvFailed
from zpd.worker.decode import DecodePhase
from zpd.worker.peers import MAX_POOLS
from zpd.worker.prefill import JobPhase

VICTIM = [5, 17, 99, 3, 42, 7, 250, 1, 64, 31, 8, 200, 13, 77, 150, 9, 21]   # 17 tokens: 2 pages
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8]          # 19 tokens: 2 pages
ROOM = 4242


def forger(c: InprocCluster, endpoint: str = "inproc://evil", **hello) -> Dealer:
    """A raw DEALER on the prefill that says hello as a decode at `endpoint`, with the
    real decode's pool (session, base address) unless `hello` overrides a field."""
    evil = Dealer(c.ctx, c.prefill.endpoint, identity=b"evil")
    evil.send(dataclasses.replace(c.decode.scheduler._hello(), decode=endpoint, **hello))
    return evil


def received(dealer: Dealer) -> list:
    out = []
    while (msg := dealer.recv(timeout=0)) is not None:
        out.append(msg)
    return out


def running_victim(c: InprocCluster) -> tuple[str, list[int]]:
    """A request decoding on the decode, and the pages that hold its KV."""
    rid = c.submit(VICTIM, 30)
    c.until(lambda: DecodePhase.RUNNING in [j.phase for j in c.decode.scheduler.jobs.values()])
    return rid, list(c.decode.scheduler.by_rid[rid].req.pages)


# --- kv_dest only from the paired decode ----------------------------------------------


@pytest.mark.parametrize("order", ["before_generate", "after_generate"])
def test_forged_kv_dest_does_not_redirect_the_write(cluster, monkeypatch, order):
    c = cluster
    victim, victim_pages = running_victim(c)
    monkeypatch.setattr(router_server, "new_room", lambda: ROOM)
    evil = forger(c)
    forged = KvDest(ROOM, 0, "forged", victim_pages[:2])     # the victim's prompt KV
    if order == "before_generate":
        evil.send(forged)
        c.pump(3)
        rid = c.submit(PROMPT, 6)
    else:
        c.silent = {"decode"}                 # the real kv_dest comes after the forged one
        rid = c.submit(PROMPT, 6)
        c.until(lambda: ROOM in c.prefill.scheduler.jobs)
        evil.send(forged)
        c.pump(3)
        c.silent = set()
    assert c.run(rid).token_ids == reference(c, PROMPT, 6)
    assert c.run(victim).token_ids == reference(c, VICTIM, 30)     # its KV was not overwritten
    got = received(evil)
    assert any(isinstance(m, HelloAck) and m.ok for m in got)
    assert [(m.room, m.status) for m in got if isinstance(m, KvFailed)] == [(ROOM, 403)]
    c.pump()
    c.check_pages()
    c.serves_again(VICTIM[:5])


def test_kv_dest_from_a_peer_without_hello_is_refused(cluster):
    c = cluster
    c.silent = {"decode"}
    rid = c.submit(PROMPT, 4)
    c.until(lambda: bool(c.prefill.scheduler.jobs))
    c.silent = set()
    stranger = Dealer(c.ctx, c.prefill.endpoint, identity=b"stranger")
    room = next(iter(c.prefill.scheduler.jobs))
    stranger.send(KvDest(room, 0, "x", [0, 1]))
    assert c.run(rid).token_ids == reference(c, PROMPT, 4)
    assert [m.status for m in received(stranger) if isinstance(m, KvFailed)] == [500]
    c.check_pages()


# --- page ids checked against the announced pool ---------------------------------------


# (page ids, cached pages) -> forged (page ids, cached pages), in a pool of n pages
BAD_PAGES = {
    "negative": lambda pages, cached, n: ([-2] + pages[1:], cached),
    # -1 is a page id like any other (cached pages are counted in `cached_pages`):
    # a decode that still sends the old sentinel is refused, never skipped
    "old_sentinel": lambda pages, cached, n: ([-1] + pages[1:], cached),
    "minus_one_inside": lambda pages, cached, n: (pages[:1] + [-1] + pages[2:], cached),
    # the prefill always writes something: at least the last page
    "cached_everything": lambda pages, cached, n: ([], cached + len(pages)),
    "cached_and_listed": lambda pages, cached, n: (pages, cached + 1),
    "past_the_end": lambda pages, cached, n: (pages[:-1] + [n], cached),
    "duplicated": lambda pages, cached, n: ([pages[0]] * len(pages), cached),
    "too_few": lambda pages, cached, n: (pages[:-1], cached),
    "too_many": lambda pages, cached, n: (pages + [next(p for p in range(n) if p not in pages)],
                                          cached),
}


@pytest.mark.parametrize("timing", ["before_compute", "after_compute"])
@pytest.mark.parametrize("bad", sorted(BAD_PAGES))
def test_bad_page_ids_fail_only_that_request(cluster, monkeypatch, bad, timing):
    c = cluster
    c.serves_again(VICTIM[:5])                            # the link is up: kv_dest goes out at once
    num_pages = c.decode.pool.num_pages

    def forged(room: int, epoch: int, rid: str, pages: list[int], cached_pages: int) -> KvDest:
        pages, cached = BAD_PAGES[bad](list(pages), cached_pages, num_pages)
        return KvDest(room, epoch, rid, pages, cached_pages=cached)
    monkeypatch.setattr(decode_module, "KvDest", forged)
    writes = []
    real_write = c.prefill.backend.write
    monkeypatch.setattr(c.prefill.backend, "write", lambda *a: (writes.append(a), real_write(*a)))
    jobs = c.prefill.scheduler.jobs
    c.silent = {"prefill" if timing == "before_compute" else "decode"}
    rid = c.submit(PROMPT, 6, stream=False)      # no first token straight from the prefill
    if timing == "before_compute":            # generate and kv_dest wait in the prefill's socket
        c.until(lambda: any(j.asked == 0 for j in c.decode.scheduler.jobs.values()))
    else:
        c.until(lambda: [j.phase for j in jobs.values()] == [JobPhase.COMPUTED])
    c.silent = set()
    got = c.run(rid)
    assert got.status == 500 and got.token_ids == [] and writes == []
    monkeypatch.undo()
    c.pump()
    c.check_pages()
    assert c.admin("pause", mode="in_place")["ok"]          # nothing stays in writing
    assert c.admin("continue")["ok"]
    c.serves_again(VICTIM[:5])


@pytest.mark.parametrize("cached", [-1, "1", 1.0, True, None])
def test_kv_dest_cached_pages_are_a_count_or_the_message_is_refused(cached):
    """The count of pages a decode holds cached is checked by the codec, as every
    field: a forged one never reaches the prefill's scheduler."""
    import orjson
    from zpd.wire.protocol import ProtocolError, decode, encode
    frames = encode(KvDest(1, 0, "r", [4, 5], cached_pages=1))
    assert decode(frames).cached_pages == 1
    header = orjson.loads(frames[0]) | {"cached_pages": cached}
    with pytest.raises(ProtocolError, match="cached_pages"):
        decode([orjson.dumps(header), *frames[1:]])
    if cached == -1:
        with pytest.raises(ProtocolError, match="cached_pages"):
            encode(KvDest(1, 0, "r", [4, 5], cached_pages=cached))


# --- hello sanity ------------------------------------------------------------------


BAD_HELLOS = {
    "no_pages": {"num_pages": 0},
    "negative_pages": {"num_pages": -4},
    "too_many_pages": {"num_pages": 2**31},
    "no_session": {"session_id": ""},
    "no_endpoint": {"endpoint": ""},
}


# The tiny model's 2 kv heads, announced as pools (rank order) around the decode's
# real pool at `b`.
BAD_POOLS = {
    "null_base": lambda b: [[0, 2, 0]],
    "base_near_2**64": lambda b: [[0, 2, 2**64 - 8192]],
    "no_pools": lambda b: [],
    "too_many_pools": lambda b: [[0, 2, b]] * (MAX_POOLS + 1),
    "pool_of_two_numbers": lambda b: [[0, 2]],
    "pool_of_four_numbers": lambda b: [[0, 2, b, 7]],
    "heads_past_the_model": lambda b: [[0, 3, b]],
    "negative_head": lambda b: [[-1, 2, b]],
    "empty_head_range": lambda b: [[1, 1, b], [0, 2, b]],
    "head_in_no_pool": lambda b: [[0, 1, b]],
    "overlapping_ranges": lambda b: [[0, 2, b], [1, 2, b]],
}


@pytest.mark.parametrize("bad", sorted(BAD_HELLOS) + sorted(BAD_POOLS) + ["prefill_session"])
def test_impossible_hello_is_refused(cluster, bad):
    c = cluster
    fields = dict(BAD_HELLOS.get(bad, {"session_id": c.prefill.backend.session_id}))
    if bad in BAD_POOLS:
        fields = {"pools": BAD_POOLS[bad](c.decode.memory.pool_addr)}
    evil = forger(c, fields.pop("endpoint", c.decode.endpoint), **fields)   # the right endpoint
    c.silent = {"decode"}
    rid = c.submit(PROMPT, 4)
    c.until(lambda: bool(c.prefill.scheduler.jobs))
    room = next(iter(c.prefill.scheduler.jobs))
    evil.send(KvDest(room, 0, "forged", [0, 1]))
    c.pump(3)
    c.silent = set()
    assert c.run(rid).token_ids == reference(c, PROMPT, 4)
    got = received(evil)
    [ack] = [m for m in got if isinstance(m, HelloAck)]
    assert not ack.ok and ack.reason
    assert [(m.room, m.status) for m in got if isinstance(m, KvFailed)] == [(room, 500)]
    c.check_pages()
    c.serves_again(VICTIM[:5])


def test_recompute_kv_dest_counts_only_from_the_decode_that_asked(cluster):
    """After a retraction the decode asks for a recompute (epoch 1) itself: a kv_dest for
    that epoch from anyone else is refused, even one that claims the decode's endpoint."""
    c = cluster
    rid = c.submit(PROMPT, 12)
    c.until(lambda: rid in c.answers and len(c.answers[rid].token_ids) >= 3)
    assert c.admin("pause", mode="retract")["ok"]
    room = c.decode.scheduler.by_rid[rid].room
    evil = forger(c, c.decode.endpoint)
    c.silent = {"decode"}                     # the prefill continues first
    req = c.admin("continue", wait=False)
    c.until(lambda: c.prefill.paused is None)
    evil.send(KvDest(room, 1, rid, [0, 1]))   # before the recompute: kept, then refused
    c.pump(3)
    c.silent = set()
    c.until(lambda: req in c.replies)
    assert c.replies[req]["ok"]
    assert c.run(rid).token_ids == reference(c, PROMPT, 12)
    assert [(m.room, m.epoch, m.status) for m in received(evil) if isinstance(m, KvFailed)] == \
        [(room, 1, 403)]
    c.pump()
    c.check_pages()


def test_a_decode_known_to_the_router_by_another_name_fails_clearly(cluster):
    """The endpoint check compares names: a decode whose hello names another endpoint
    than the router's gets 403 with a message that says so. The prefill cannot tell it
    from an impostor, so its job waits for the right kv_dest until its deadline."""
    c = cluster
    links = c.decode.scheduler.links
    links.hello = dataclasses.replace(links.hello, decode="inproc://another-name")
    got = c.run(c.submit(PROMPT, 4))
    assert got.status == 403
    assert "not given to decode inproc://another-name" in got.finish["message"]
    assert [j.phase for j in c.prefill.scheduler.jobs.values()] == [JobPhase.COMPUTED]
    c.clock.now += c.prefill.cfg.deadlines.wait_kv_dest + 1
    c.pump()
    c.check_pages()
