"""Which peers' sessions are open, and opening one without freezing the process.

Mooncake opens a session to a peer (fetches its segment descriptor) inside a call that
holds the GIL until the peer answers its handshake. Measured with 0.3.13: against a
listener that accepts and never answers, `get_first_buffer_address` held the GIL for
62 s, so every thread of the process stood still (no pongs: peers declared it dead).
And a first write to a peer whose session is not open does the same handshake inside
the submit. So a session is opened in two steps: the driver's `probe` first checks,
in another process and within a timeout, that the peer answers the handshake (a wait
on a child process releases the GIL; transport/probe.py); only then does the helper
thread open it in this process, which is quick against a peer that answers. Writes to a peer go out
only once its session is open; while it is being probed they wait (their transfer
deadline still runs), and once the probe has failed they fail at once with its reason.

What this does not cover: a peer that answers the probe and goes silent in the
moment before the in-process open. Only known peers are probed (the prefill connects
to a decode once its `hello` is accepted; with --curve-keys only cluster keys can say
hello).
"""
from __future__ import annotations

import logging
import threading
from typing import Callable, Protocol

log = logging.getLogger("transport")

OPEN, PROBING = "open", "probing"


class Prober(Protocol):
    def probe(self, peer: str, timeout_s: float) -> None:
        """Return once `peer` answered a handshake within `timeout_s`; raise otherwise.
        Must not hold the GIL while it waits."""


class Sessions:
    """Session state per peer: OPEN, PROBING, or why it could not be opened."""

    def __init__(self, prober: Prober, timeout_s: float, post_open: Callable[[str], None]) -> None:
        self.prober, self.timeout_s, self.post_open = prober, timeout_s, post_open
        self._lock = threading.Lock()
        self._states: dict[str, str] = {}
        self._probing: set[str] = set()

    def state(self, peer: str) -> str | None:
        """OPEN, PROBING, a failure reason, or None (never asked to connect)."""
        with self._lock:
            return self._states.get(peer)

    def connect(self, peer: str) -> None:
        """Probe `peer` on a thread of its own, then have its session opened. An open
        session stays usable meanwhile (a new hello re-checks and refreshes it)."""
        with self._lock:
            if peer in self._probing:
                return
            self._probing.add(peer)
            if self._states.get(peer) != OPEN:
                self._states[peer] = PROBING
        threading.Thread(target=self._probe, args=(peer,), name=f"probe {peer}",
                         daemon=True).start()

    def opened(self, peer: str, failure: str = "") -> None:
        """The helper thread's in-process open of `peer`: done, or why it failed."""
        with self._lock:
            self._states[peer] = f"session to {peer} not open: {failure}" if failure else OPEN

    def _probe(self, peer: str) -> None:
        try:
            self.prober.probe(peer, self.timeout_s)
        except Exception as exc:  # noqa: BLE001 - any failure: the peer is not usable
            log.warning("session to %s not opened: %s", peer, exc)
            self._end_probe(peer, f"session to {peer} not open: {exc}")
            return
        self._end_probe(peer, None)
        self.post_open(peer)

    def _end_probe(self, peer: str, failure: str | None) -> None:
        with self._lock:
            self._probing.discard(peer)
            if failure is not None:
                self._states[peer] = failure
