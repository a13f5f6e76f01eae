"""Mooncake's handshake, tried in a helper process (transport/sessions.py says why).

One long-lived child per backend holds its own TransferEngine and answers one probe at
a time over a pipe: "peer" in, "ok" or "fail" out. A live peer answers in milliseconds.
A peer that does not answer freezes the child (Mooncake holds its GIL), never us: after
`timeout_s` the child is killed and the next probe starts a new one (about a second,
mostly its import of Mooncake).
"""
from __future__ import annotations

import os
import select
import subprocess
import sys
import threading
import time

from .base import TransportError

_SERVER = """
import sys
from mooncake.engine import TransferEngine
engine = TransferEngine()
host, protocol, device = sys.argv[1:4]
if engine.initialize(host, "P2PHANDSHAKE", protocol, device) != 0:
    sys.exit(3)
print("ready", flush=True)
for line in sys.stdin:
    print("ok" if engine.get_first_buffer_address(line.strip()) else "fail", flush=True)
"""
START_S = 60.0          # the child's import and engine start, on a busy machine


class HandshakeProber:
    """Probes peers from a child process; `probe` may be called from any thread."""

    def __init__(self, host: str, protocol: str, device: str) -> None:
        self._argv = [sys.executable, "-c", _SERVER, host, protocol, device]
        self._lock = threading.Lock()
        self._child: subprocess.Popen | None = None
        self._ready = False                # the child said "ready"
        self._closed = False
        with self._lock:
            self._start()                  # now, so it is warm by the first hello

    def probe(self, peer: str, timeout_s: float) -> None:
        """Return once `peer` gave its segment descriptor; raise TransportError if it
        refused or did not answer within `timeout_s`."""
        if "\n" in peer:
            raise TransportError(f"bad session name {peer!r}")
        with self._lock:
            if self._closed:
                raise TransportError("backend closed")
            if self._child is None or self._child.poll() is not None:
                self._start()
            if not self._ready:
                if self._read(START_S) != "ready":
                    self._kill()
                    raise TransportError("the handshake helper process did not start")
                self._ready = True
            self._child.stdin.write(f"{peer}\n".encode())
            self._child.stdin.flush()
            answer = self._read(timeout_s)
            if answer is None:
                self._kill()               # frozen inside Mooncake: only killing ends it
                raise TransportError(f"{peer} did not answer Mooncake's handshake within "
                                     f"{timeout_s:g} s")
            if answer != "ok":
                raise TransportError(f"{peer} refused Mooncake's handshake")

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._kill()

    def _start(self) -> None:
        self._child = subprocess.Popen(self._argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       stderr=subprocess.DEVNULL)
        self._ready = False

    def _kill(self) -> None:
        if self._child is not None:
            self._child.kill()
            self._child.wait()
            self._child = None

    def _read(self, timeout_s: float) -> str | None:
        """One line from the child within `timeout_s`; None on timeout or its death."""
        fd, line, deadline = self._child.stdout.fileno(), b"", time.monotonic() + timeout_s
        while not line.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 256)
            if not chunk:
                return None
            line += chunk
        return line.decode().strip()
