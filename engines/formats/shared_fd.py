"""CPU tensors shared by file descriptor (torch's default sharing strategy): what
arrives is `multiprocessing.resource_sharer.DupFd`, the address of a listener in the
sender's process and a key; the descriptor itself is handed over by that listener,
over a Unix socket, to a process that proves it holds the sender's multiprocessing
authkey. So only a receiver started by the sender through multiprocessing (a
trainer's colocated server as its child) can take it; any other gets the
authentication refused, and the payload is refused naming the fix (the
"file_system" strategy, whose segments any process on the host can map).

Every read on that socket is bounded (SO_RCVTIMEO): a listener that accepts and
never answers costs HANDOFF_TIMEOUT_S, not the worker's sync step. The descriptor
must hold the bytes the storage maps (a shorter file would SIGBUS the worker)."""
from __future__ import annotations

import multiprocessing
import multiprocessing.connection as mpc
import os
import re
import socket
import struct
from multiprocessing import reduction
from typing import Any

from engines.formats.payload_checks import FILE_SYSTEM_HINT, PayloadError, Record, integer

HANDOFF_TIMEOUT_S = 10
_LISTENER = re.compile(r"(/[\w.-]+)*/pymp-\w+/listener-\w+")


class SharedFd(Record):
    """A pickled multiprocessing.resource_sharer.DupFd: (listener address, key)."""
    FIELDS = ("_id",)
    PICKLED_AS = "multiprocessing.resource_sharer.DupFd"

    def detach(self) -> int:
        """The descriptor, from the sender's listener (torch's rebuild_storage_fd calls
        this once and closes what it returns)."""
        ident = self.field("_id")
        if not isinstance(ident, tuple) or len(ident) != 2 or not isinstance(ident[0], str) \
                or not _LISTENER.fullmatch(ident[0]) or "/../" in ident[0]:
            raise PayloadError(f"DupFd address {ident!r:.80} is not a multiprocessing listener's")
        return _receive(ident[0], integer("DupFd key", ident[1]))


def _receive(address: str, key: int) -> int:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    bound = struct.pack("ll", HANDOFF_TIMEOUT_S, 0)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, bound)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, bound)
    try:
        sock.connect(address)
    except OSError as e:
        sock.close()
        raise _refused(f"the sender's listener is gone ({e.strerror})") from None
    conn = mpc.Connection(sock.detach())
    try:
        authkey = multiprocessing.current_process().authkey
        mpc.answer_challenge(conn, authkey)      # what multiprocessing's Client does
        mpc.deliver_challenge(conn, authkey)
        conn.send((key, os.getpid()))
        return reduction.recv_handle(conn)
    except multiprocessing.AuthenticationError:
        raise _refused("this server is not a multiprocessing child of the sender") from None
    except (OSError, EOFError, RuntimeError) as e:
        raise _refused(f"the sender did not hand it over: {type(e).__name__}: {e}") from None
    finally:
        conn.close()


def _refused(why: str) -> PayloadError:
    return PayloadError(f"the payload's CPU tensors were shared by file descriptor, which only "
                        f"the sender's own child process can receive ({why}); {FILE_SYSTEM_HINT}")


def checked_fd_size(fd: int, nbytes: int) -> None:
    """The file behind `fd` holds the `nbytes` a storage would map."""
    held = os.fstat(fd).st_size
    if held < nbytes:
        raise PayloadError(f"a shared descriptor holds {held} bytes, not the {nbytes} its "
                           "storage maps")


class Detached:
    """A descriptor already received, handed to torch's rebuild_storage_fd."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def detach(self) -> int:
        return self.fd


def fd_argument(value: Any) -> SharedFd:
    if not isinstance(value, SharedFd):
        raise PayloadError(f"rebuild_storage_fd of {type(value).__name__}, not a DupFd")
    return value
