"""Sessions are probed before they are opened (transport/sessions.py): a peer that does
not answer fails its writes and nothing else; a slow one delays only its own writes."""
from __future__ import annotations

import threading
import time

import transport
from tests.unit.transport_bufs import Buf, threaded, wait_for
from transport.fake import FabricDriver


class ProbedDriver(FabricDriver):
    """A fabric whose probe of `slow` peers takes `delay` s and of `dead` ones fails."""

    def __init__(self, fabric: transport.FakeFabric, delay: float = 0.0,
                 dead: tuple[str, ...] = ()) -> None:
        super().__init__(fabric)
        self.delay, self.dead, self.probes, self.submits = delay, dead, [], []

    def probe(self, peer: str, timeout_s: float) -> None:
        self.probes.append(peer)
        if peer in self.dead:
            raise transport.TransportError("did not answer the handshake")
        time.sleep(self.delay)
        super().probe(peer, timeout_s)

    def submit(self, peer, run):
        self.submits.append(peer)
        return super().submit(peer, run)


def test_a_peer_that_fails_its_probe_fails_its_writes_without_a_submit():
    fabric, src, dst = transport.FakeFabric(), Buf(100), Buf(100)
    peer, _ = threaded(fabric, dst)
    driver = ProbedDriver(fabric, dead=(peer.session_id,))
    a, _ = threaded(fabric, src, driver)
    a.connect(peer.session_id)
    a.write(1, peer.session_id, [(src.addr, dst.addr, 10)])
    (c,) = wait_for(a, 1)
    assert not c.ok and "not open" in c.reason and "handshake" in c.reason
    assert driver.submits == []
    a.close()
    peer.close()


def test_a_slow_probe_delays_only_its_own_peer():
    fabric, src, fast_buf, slow_buf = transport.FakeFabric(), Buf(100), Buf(100), Buf(100)
    fast, _ = threaded(fabric, fast_buf)
    slow, _ = threaded(fabric, slow_buf)
    driver = ProbedDriver(fabric)
    a, _ = threaded(fabric, src, driver)
    a.connect(fast.session_id)
    deadline = time.monotonic() + 5
    while a._sessions.state(fast.session_id) != "open" and time.monotonic() < deadline:
        time.sleep(0.01)
    driver.delay = 0.5
    started = time.monotonic()
    a.connect(slow.session_id)                     # returns at once: the probe has a thread
    assert time.monotonic() - started < 0.1
    a.write(1, slow.session_id, [(src.addr, slow_buf.addr, 10)])
    a.write(2, fast.session_id, [(src.addr, fast_buf.addr, 10)])
    first = wait_for(a, 1)[0]
    assert first.transfer_id == 2 and first.ok     # not held behind the slow peer's probe
    second = wait_for(a, 1)[0]
    assert second.transfer_id == 1 and second.ok and time.monotonic() - started >= 0.5
    assert driver.probes.count(slow.session_id) == 1
    for b in (a, fast, slow):
        b.close()


def test_a_write_to_a_peer_never_connected_connects_first():
    fabric, src, dst = transport.FakeFabric(), Buf(100), Buf(100)
    peer, _ = threaded(fabric, dst)
    driver = ProbedDriver(fabric)
    a, _ = threaded(fabric, src, driver)
    a.write(1, peer.session_id, [(src.addr, dst.addr, 10)])
    (c,) = wait_for(a, 1)
    assert c.ok and driver.probes == [peer.session_id] and driver.opened == [peer.session_id]
    a.close()
    peer.close()


def test_connects_during_a_probe_start_one_probe():
    fabric, src, dst = transport.FakeFabric(), Buf(100), Buf(100)
    peer, _ = threaded(fabric, dst)
    driver = ProbedDriver(fabric, delay=0.2)
    a, _ = threaded(fabric, src, driver)
    threads = [threading.Thread(target=a.connect, args=(peer.session_id,)) for _ in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    time.sleep(0.4)
    assert driver.probes == [peer.session_id]
    a.close()
    peer.close()
