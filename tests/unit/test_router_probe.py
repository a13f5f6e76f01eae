"""The router's heartbeat probes the clients that have requests, from its shares (not
a pass over every flight): a client that hung up has its running requests ended (it
has none queued: nothing else names it), its share given back, and the others' go on."""
from __future__ import annotations

from inproc import InprocCluster, send_raw
from zpd.wire.net import Dealer
from zpd.wire.protocol import Generate

PROMPT = [5, 17, 99, 3, 42]


def test_a_client_that_hung_up_loses_its_requests_at_the_next_heartbeat():
    c = InprocCluster()
    try:
        gone = Dealer(c.ctx, c.router.endpoint, identity=b"gone")
        sampling = {"temperature": 0, "max_new_tokens": 200, "ignore_eos": True}
        for rid in ("g-1", "g-2"):
            send_raw(gone, Generate(rid, PROMPT, stream=True), sampling)
        c.until(lambda: {"g-1", "g-2"} <= set(c.router.inflight))
        assert set(c.router.shares.held) == {b"gone"} and not c.router.queued
        assert c.admin("pause", mode="in_place")["ok"]       # no tokens: only the probe
        gone.close()                                          # can find it gone
        c.advance(1.0)                   # two heartbeats: the probe is refused
        assert not {"g-1", "g-2"} & set(c.router.inflight)
        assert c.admin("continue")["ok"]
        stays = c.submit(PROMPT, 4)
        assert b"gone" not in c.router.shares.held
        assert c.run(stays).finish["type"] == "length"    # the other client's ran
        assert c.router.shares.held == {} and not c.router.inflight
    finally:
        c.close()
