"""Buffers and bounded waits shared by the transport unit tests."""
from __future__ import annotations

import ctypes
import random
import select
import time

import transport
from transport.fake import FabricDriver
from transport.threaded import ThreadedBackend

PAGE = 64


class Buf:
    """A ctypes buffer with its address, filled with a recognisable pattern."""

    def __init__(self, nbytes: int, seed: int | None = None) -> None:
        self.raw = ctypes.create_string_buffer(nbytes)
        self.addr = ctypes.addressof(self.raw)
        if seed is not None:
            rng = random.Random(seed)
            ctypes.memmove(self.addr, bytes(rng.randrange(256) for _ in range(nbytes)), nbytes)

    def page(self, i: int) -> bytes:
        return self.raw.raw[i * PAGE:(i + 1) * PAGE]


def wait_for(backend: transport.Backend, n: int = 1, timeout: float = 5.0) -> list[transport.Completion]:
    """Poll like a scheduler: sleep on the fd, drain, until n completions came."""
    done: list[transport.Completion] = []
    deadline = time.monotonic() + timeout
    while len(done) < n:
        left = deadline - time.monotonic()
        assert left > 0, f"only {done} after {timeout} s"
        select.select([backend.fileno()], [], [], left)
        done += backend.poll_completions()
    return done


def wait_until(condition, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.001)


def readable(backend: transport.Backend) -> bool:
    return bool(select.select([backend.fileno()], [], [], 0)[0])


def fake(fabric: transport.FakeFabric, buf: Buf, **kw: int) -> transport.Backend:
    backend = transport.create_backend("fake", fabric=fabric, **kw)
    backend.register(buf.addr, len(buf.raw))
    return backend


def threaded(fabric: transport.FakeFabric, buf: Buf, driver: FabricDriver | None = None,
             timeout_s: float = 10.0) -> tuple[ThreadedBackend, FabricDriver]:
    driver = driver or FabricDriver(fabric)
    backend = ThreadedBackend(driver, transfer_timeout_s=timeout_s)
    backend.register(buf.addr, len(buf.raw))
    return backend, driver
