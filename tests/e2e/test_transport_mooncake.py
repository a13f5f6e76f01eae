"""The Mooncake backend for real, over TCP on 127.0.0.1: two engines in this
process, plus a peer process that the frozen/killed-peer tests stop and kill."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

import transport
from transport.threaded import HANDSHAKE_TIMEOUT_S

pytest.importorskip("mooncake.engine", reason="Mooncake is not installed "
                    "(pip install mooncake-transfer-engine-non-cuda)")
np = pytest.importorskip("numpy")
zmq = pytest.importorskip("zmq")

PAGE = 4096
PAGES = 8192          # 32 MiB per side
TIMEOUT_S = 4.0       # Mooncake's own timeouts become 2 s


@pytest.fixture(scope="module")
def pair():
    a = transport.create_backend("mooncake", host="127.0.0.1", transfer_timeout_s=TIMEOUT_S)
    b = transport.create_backend("mooncake", host="127.0.0.1", transfer_timeout_s=TIMEOUT_S)
    src = np.random.default_rng(0).integers(0, 256, PAGES * PAGE, dtype=np.uint8)
    dst = np.zeros(PAGES * PAGE, dtype=np.uint8)
    a.register(src.ctypes.data, src.nbytes)
    b.register(dst.ctypes.data, dst.nbytes)
    yield a, b, src, dst
    a.close()
    b.close()


def wait_one(backend: transport.Backend, timeout: float = 10.0) -> transport.Completion:
    """The next completion, in the order the backend reported them (two that finish
    together on a loaded machine come in one poll; the second waits here)."""
    kept = vars(backend).setdefault("_completions_not_taken", [])
    if kept:
        return kept.pop(0)
    poller = zmq.Poller()
    poller.register(backend.fileno(), zmq.POLLIN)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if poller.poll(int((deadline - time.monotonic()) * 1000) + 1):
            done = backend.poll_completions()
            if done:
                kept.extend(done[1:])
                return done[0]
    raise AssertionError(f"no completion within {timeout} s")


def pages_equal(src, dst, src_pages, dst_pages) -> bool:
    s = src.reshape(PAGES, PAGE)[np.asarray(src_pages)]
    d = dst.reshape(PAGES, PAGE)[np.asarray(dst_pages)]
    return bool((s == d).all())


def test_scattered_pages_in_several_batches_arrive_exactly(pair) -> None:
    a, b, src, dst = pair
    rng = np.random.default_rng(1)
    src_pages = rng.choice(PAGES, 3000, replace=False)
    dst_pages = rng.permutation(PAGES)[:3000]
    runs = transport.coalesce_runs(src.ctypes.data, src_pages, dst.ctypes.data, dst_pages, PAGE)
    assert len(runs) > 2 * transport.MAX_BATCH_ENTRIES  # three batches at least
    dst[:] = 0
    a.write(1, b.session_id, runs)
    c = wait_one(a)
    assert (c.transfer_id, c.ok, c.nbytes) == (1, True, 3000 * PAGE), c
    assert pages_equal(src, dst, src_pages, dst_pages)
    untouched = np.setdiff1d(np.arange(PAGES), dst_pages)
    assert not dst.reshape(PAGES, PAGE)[untouched].any()


def test_mostly_contiguous_allocation_coalesces_to_few_runs(pair) -> None:
    a, b, src, dst = pair
    src_pages = np.arange(100, 1124)
    dst_pages = np.concatenate([np.arange(5000, 5600), np.arange(200, 624)])
    runs = transport.coalesce_runs(src.ctypes.data, src_pages, dst.ctypes.data, dst_pages, PAGE)
    assert len(runs) == 2
    a.write(2, b.session_id, runs)
    assert wait_one(a).ok
    assert pages_equal(src, dst, src_pages, dst_pages)


def test_out_of_range_write_fails_and_later_writes_succeed(pair) -> None:
    a, b, src, dst = pair
    end = dst.ctypes.data + dst.nbytes
    a.write(3, b.session_id, [(src.ctypes.data, end - PAGE // 2, PAGE)])
    c = wait_one(a)
    assert (c.transfer_id, c.ok) == (3, False) and c.seconds < 1.0, c
    dst[:PAGE] = 0
    a.write(4, b.session_id, [(src.ctypes.data, dst.ctypes.data, PAGE)])
    assert wait_one(a).ok and (dst[:PAGE] == src[:PAGE]).all()


def test_many_small_transfers_in_flight_at_once(pair) -> None:
    a, b, src, dst = pair
    for tid in range(100, 300):
        a.write(tid, b.session_id, [(src.ctypes.data + tid * PAGE, dst.ctypes.data + tid * PAGE, PAGE)])
    done, deadline = [], time.monotonic() + 10
    while len(done) < 200 and time.monotonic() < deadline:
        done += a.poll_completions()
        time.sleep(0.001)
    assert sorted(c.transfer_id for c in done) == list(range(100, 300))
    assert all(c.ok for c in done)
    assert (dst[100 * PAGE:300 * PAGE] == src[100 * PAGE:300 * PAGE]).all()


PEER = """
import sys, time, numpy as np, transport
b = transport.create_backend("mooncake", host="127.0.0.1")
buf = np.zeros(1 << 20, np.uint8)
b.register(buf.ctypes.data, buf.nbytes)
print(b.session_id, buf.ctypes.data, flush=True)
time.sleep(120)
"""


@pytest.fixture
def peer_process():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.Popen([sys.executable, "-c", PEER], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, cwd=root,
                            env={**os.environ, "PYTHONPATH": root})
    line = proc.stdout.readline().split()
    assert len(line) == 2, "peer process did not start"
    yield proc, line[0], int(line[1])
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
    proc.wait(timeout=10)


def _wait_stopped(pid: int, timeout: float = 5.0) -> None:
    """Until /proc says `pid` is stopped (state T)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rpartition(")")[2].split()[0] == "T":
                return
        time.sleep(0.005)
    raise AssertionError(f"process {pid} did not stop within {timeout} s")


def test_frozen_peer_fails_before_the_deadline_then_recovers(pair, peer_process) -> None:
    a, _, src, _ = pair
    proc, session, addr = peer_process
    a.write(10, session, [(src.ctypes.data, addr, PAGE)])
    assert wait_one(a).ok
    os.kill(proc.pid, signal.SIGSTOP)
    _wait_stopped(proc.pid)         # kill() returns before a busy peer has stopped
    started = time.monotonic()
    a.write(11, session, [(src.ctypes.data, addr, PAGE)])
    c = wait_one(a)
    elapsed = time.monotonic() - started
    # Mooncake's progress timeout (2 s) ends it, not our own 4 s deadline.
    assert not c.ok and "timeout" not in c.reason and 1.5 < elapsed < TIMEOUT_S, (c, elapsed)
    os.kill(proc.pid, signal.SIGCONT)
    a.write(12, session, [(src.ctypes.data, addr, PAGE)])
    assert wait_one(a).ok, "a peer that failed once must not stay blacklisted"


def test_killed_peer_fails_fast(pair, peer_process) -> None:
    a, _, src, _ = pair
    proc, session, addr = peer_process
    a.write(20, session, [(src.ctypes.data, addr, PAGE)])
    assert wait_one(a).ok
    proc.kill()
    proc.wait(timeout=10)
    a.write(21, session, [(src.ctypes.data, addr, PAGE)])
    c = wait_one(a)
    assert not c.ok and c.seconds < TIMEOUT_S, c


def test_session_opened_ahead_keeps_a_frozen_peer_from_stalling_others(pair, peer_process) -> None:
    """connect() does the handshake while the peer is alive. Without it, the first write
    to a peer frozen meanwhile does the handshake, which stalls every write of the engine
    (measured: > 60 s, writes to other, already open peers included)."""
    _, b, src, dst = pair
    proc, session, addr = peer_process
    a = transport.create_backend("mooncake", host="127.0.0.1", transfer_timeout_s=TIMEOUT_S)
    try:
        a.register(src.ctypes.data, src.nbytes)
        a.connect(session)
        a.connect(b.session_id)
        # Both sessions open (probed, then opened by the helper thread): a write to each
        # completes. Only then does the peer freeze.
        a.write(28, session, [(src.ctypes.data, addr, PAGE)])
        a.write(29, b.session_id, [(src.ctypes.data, dst.ctypes.data, PAGE)])
        assert all(wait_one(a).ok for _ in range(2))
        os.kill(proc.pid, signal.SIGSTOP)
        started = time.monotonic()
        a.write(30, session, [(src.ctypes.data, addr, PAGE)])       # to the frozen peer
        a.write(31, b.session_id, [(src.ctypes.data + PAGE, dst.ctypes.data + 7 * PAGE, PAGE)])
        first = wait_one(a)
        assert (first.transfer_id, first.ok) == (31, True) and time.monotonic() - started < 1.0, first
        assert (dst[7 * PAGE:8 * PAGE] == src[PAGE:2 * PAGE]).all()
        frozen = wait_one(a)
        assert frozen.transfer_id == 30 and not frozen.ok, frozen
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        a.close()


def test_a_peer_that_never_answers_the_handshake_freezes_nothing() -> None:
    """Mooncake holds the GIL while it opens a session to a peer that accepts and never
    answers (62 s measured): the session is probed in a child process first, so this
    process's threads keep running, the write to that peer fails within the probe
    timeout, and writes to live peers go on."""
    import socket
    import threading

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)                                   # accepts, never answers
    peer = f"127.0.0.1:{silent.getsockname()[1]}"
    a = transport.create_backend("mooncake", host="127.0.0.1", transfer_timeout_s=8.0)
    b = transport.create_backend("mooncake", host="127.0.0.1", transfer_timeout_s=8.0)
    src, dst = np.ones(4096, dtype=np.uint8), np.zeros(4096, dtype=np.uint8)
    a.register(src.ctypes.data, src.nbytes)
    b.register(dst.ctypes.data, dst.nbytes)
    ticks, stop = [time.monotonic()], threading.Event()

    def tick() -> None:
        while not stop.wait(0.02):
            ticks.append(time.monotonic())

    ticker = threading.Thread(target=tick, daemon=True)
    ticker.start()
    try:
        started = time.monotonic()
        a.connect(peer)
        assert time.monotonic() - started < 0.5
        a.write(1, peer, [(src.ctypes.data, 0x1000, 16)])
        a.write(2, b.session_id, [(src.ctypes.data, dst.ctypes.data, 4096)])
        got = {c.transfer_id: c for c in (wait_one(a), wait_one(a))}
        assert got[2].ok and bytes(dst) == bytes(src)
        assert not got[1].ok and "handshake" in got[1].reason, got[1]
        assert time.monotonic() - started < HANDSHAKE_TIMEOUT_S + 2.0
    finally:
        stop.set()
        ticker.join()
        a.close()
        b.close()
        silent.close()
    gaps = [y - x for x, y in zip(ticks, ticks[1:])]
    assert max(gaps) < 0.5, max(gaps)                  # no thread of ours stood still
