"""A decode that was frozen (SIGSTOP) or a router it stopped hearing for a while: the
decode's silence check counts only time it listened, and a router found silent that
pings again keeps its requests (tests/unit/inproc.py, one process, a fake clock)."""
from __future__ import annotations

from tests.unit.inproc import InprocCluster, reference

PROMPT = [5, 17, 99, 3, 42, 7, 250]
LONG = 200          # tokens: more decode steps than the `advance`s below turn


def test_a_thawed_decode_does_not_find_its_router_silent():
    c = InprocCluster()
    try:
        first = c.submit(PROMPT, LONG)
        c.until(lambda: first in c.answers and len(c.answers[first].token_ids) >= 2)
        c.advance(1.0)                          # the router has pinged the decode
        assert c.decode.pinged_at
        c.silent |= {"router", "decode"}       # both frozen; the router's pings stop too
        c.clock.now += 10.0
        c.silent.discard("decode")              # the decode wakes first: its check runs
        for _ in range(3):                      # before any ping of the router is read
            c.decode.run_once(block=False)
        assert not c.decode.silent
        c.silent.clear()
        second = c.submit(PROMPT[::-1], LONG)
        c.advance(11.0, step=1.0)               # past the grace of a silent router's requests
        for rid, prompt in ((first, PROMPT), (second, PROMPT[::-1])):
            answer = c.run(rid, rounds=600)
            assert answer.finish["type"] == "length", answer.finish
            assert answer.token_ids == reference(c, prompt, LONG)
        c.check_pages()
    finally:
        c.close()


def test_a_router_heard_again_within_the_grace_keeps_its_requests():
    c = InprocCluster()
    try:
        rid = c.submit(PROMPT, LONG)
        c.until(lambda: rid in c.answers and len(c.answers[rid].token_ids) >= 2)
        c.advance(1.0)
        assert c.decode.pinged_at
        c.silent.add("router")                  # frozen past the decode's peer timeout
        c.advance(3.0, step=1.0)
        assert c.decode.silent                  # found silent: its requests have the grace
        c.silent.clear()
        c.advance(11.0, step=1.0)               # the grace ends meanwhile
        assert not c.decode.silent
        answer = c.run(rid, rounds=600)
        assert answer.finish["type"] == "length", answer.finish
        assert answer.token_ids == reference(c, PROMPT, LONG)
        c.check_pages()
    finally:
        c.close()
