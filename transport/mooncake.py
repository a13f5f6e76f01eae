"""The Mooncake TransferEngine backend (P2PHANDSHAKE: no metadata server).

A peer's session id is f"{host}:{rpc_port}". Each run is one
`transfer_submit_write` (Mooncake's only non-blocking submit in the Python
API), polled with `transfer_check_status` by the helper thread (worker.py
says why this beats the busy-polling blocking calls on small machines).
Do not use `transfer_check_status` on a multi-entry `batch_transfer_async_write`
id: it looks at entry 0 only and frees the whole batch when that one is done
(measured: it returned "done" while the other entries were still in flight).

Timeouts. Mooncake, not our helper, must end a write to a frozen peer, so its
own timeouts are set below `transfer_timeout_s` before the engine starts
(each to max(1, floor(transfer_timeout_s / 2)) seconds, or left at a smaller
value already in the environment):

- MC_TCP_PROGRESS_TIMEOUT_SEC: a TCP write with no payload progress this long
  fails (default 30 s). Measured: set to 2, a write to a SIGSTOPped peer
  failed after 2.0 s, and writes succeeded again right after SIGCONT.
- MC_TCP_STATUS_TIMEOUT_SEC: waiting for the peer's status frame (default 30 s).

They are process-wide; the smallest value any backend asked for wins.
MC_TRANSFER_TIMEOUT is not set: it only bounds Mooncake's blocking calls
(at least 5 s), which this backend does not use. MC_SLICE_TIMEOUT had no
effect on TCP. On RDMA, and against a peer that trickles bytes slowly, the
helper's own deadline (`transfer_timeout_s`) is the bound: the transfer then
fails with "timeout" while its last entries may still finish inside Mooncake.

A killed peer fails the next write within a millisecond; a failure does not
blacklist the peer (a write after an out-of-range rejection or after a frozen
peer resumes succeeds at once; tests/e2e/test_transport_mooncake.py).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from .base import BackendUnavailableError, Run, TransportError
from .probe import HandshakeProber
from .threaded import DONE, FAILED, PENDING, ThreadedBackend

log = logging.getLogger("transport")

TIMEOUT_ENV_VARS = ("MC_TCP_PROGRESS_TIMEOUT_SEC", "MC_TCP_STATUS_TIMEOUT_SEC")

# transfer_submit_write returns 0 when it cannot submit (measured on
# 0.3.13.post1); newer sources return -1, which pybind shows as 2**64 - 1.
_REFUSED = {0, -1, 2**64 - 1}

INSTALL_HINT = ("pip install mooncake-transfer-engine-non-cuda (CPU), "
                "mooncake-transfer-engine (CUDA 12) or mooncake-transfer-engine-cuda13 "
                "(CUDA 13), exactly one")
LIBS_HINT = "apt-get install -y libibverbs1 librdmacm1 libnuma1"


def import_transfer_engine() -> Any:
    """Return Mooncake's TransferEngine class or raise BackendUnavailableError."""
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:
        raise BackendUnavailableError(_unavailable_message(exc)) from exc
    except OSError as exc:  # a broken shared library can surface as OSError
        raise BackendUnavailableError(_unavailable_message(exc)) from exc
    return TransferEngine


def _unavailable_message(exc: BaseException) -> str:
    text = str(exc)
    if ".so" in text or "shared object" in text:
        if "cuda" in text.lower():
            return (f"Mooncake is installed but needs CUDA libraries that are missing ({text}). "
                    f"On a machine without CUDA: pip uninstall mooncake-transfer-engine && "
                    f"pip install mooncake-transfer-engine-non-cuda")
        return (f"Mooncake is installed but a shared library it needs is missing ({text}). "
                f"Install them with: {LIBS_HINT}")
    return f"The mooncake transport backend needs Mooncake ({text}). Install it with: {INSTALL_HINT}"


def configure_timeouts(transfer_timeout_s: float, environ: Any = os.environ) -> dict[str, str]:
    """Set Mooncake's own timeouts below ours; return what was set."""
    wanted = max(1, int(transfer_timeout_s / 2))
    chosen = {}
    for name in TIMEOUT_ENV_VARS:
        current = environ.get(name, "")
        value = wanted
        if current.isdigit() and 0 < int(current) < wanted:
            value = int(current)
        environ[name] = chosen[name] = str(value)
    return chosen


class MooncakeDriver:
    """The Driver for one Mooncake TransferEngine (see threaded.Driver)."""

    def __init__(self, host: str, device_name: str, protocol: str, transfer_timeout_s: float) -> None:
        engine_cls = import_transfer_engine()
        timeouts = configure_timeouts(transfer_timeout_s)
        self._engine = engine_cls()
        if self._engine.initialize(host, "P2PHANDSHAKE", protocol, device_name) != 0:
            raise TransportError(
                f"Mooncake initialize({host!r}, P2PHANDSHAKE, {protocol!r}, {device_name!r}) "
                "failed; the cause is in Mooncake's log on stderr")
        self.session_id = f"{host}:{self._engine.get_rpc_port()}"
        self._prober = HandshakeProber(host, protocol, device_name)
        log.info("mooncake engine %s ready (%s)", self.session_id, timeouts)

    def register(self, addr: int, length: int) -> None:
        if self._engine.register_memory(addr, length) != 0:
            raise TransportError(f"Mooncake could not register {length} bytes at {addr:#x}")

    def unregister(self, addr: int) -> None:
        if self._engine.unregister_memory(addr) != 0:
            raise TransportError(f"Mooncake could not unregister the region at {addr:#x}")

    def submit(self, peer: str, run: Run) -> object | None:
        handle = self._engine.transfer_submit_write(peer, run[0], run[1], run[2])
        return None if handle in _REFUSED else handle

    def probe(self, peer: str, timeout_s: float) -> None:
        self._prober.probe(peer, timeout_s)

    def open(self, peer: str) -> None:
        # Fetches the peer's segment descriptor (the P2P handshake) and caches it.
        if not self._engine.get_first_buffer_address(peer):
            raise TransportError(f"Mooncake could not open the session to {peer}")

    def check(self, handle: object) -> int:
        state = self._engine.transfer_check_status(handle)
        if state == 0:
            return PENDING
        # -2 (timeout) leaves the handle allocated inside Mooncake; a small
        # leak is safer than freeing a batch whose entry may still run.
        return DONE if state == 1 else FAILED

    def close(self, outstanding: int) -> None:
        if outstanding:
            log.warning("closing Mooncake engine %s with %d writes still in flight",
                        self.session_id, outstanding)
        # Measured: destroying an engine with writes pending to a frozen peer
        # returns in <1 s and does not crash.
        self._engine = None
        self._prober.close()


class MooncakeBackend(ThreadedBackend):
    """Writes through a Mooncake TransferEngine; blocking work on a helper thread."""

    def __init__(self, host: str = "127.0.0.1", device_name: str = "", protocol: str = "tcp",
                 transfer_timeout_s: float = 10.0) -> None:
        if transfer_timeout_s <= 0:
            raise TransportError(f"transfer_timeout_s must be positive, got {transfer_timeout_s}")
        super().__init__(MooncakeDriver(host, device_name, protocol, transfer_timeout_s),
                         transfer_timeout_s=transfer_timeout_s)
