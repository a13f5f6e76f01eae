"""The TCP sockets a process listens on, read from /proc (Linux): what an attack test
checks a process exposes."""
from __future__ import annotations

import ipaddress
import os
import socket


def _inodes(pid: int) -> set[str]:
    """The inodes of the sockets `pid` has open."""
    found = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue                          # closed meanwhile
        if target.startswith("socket:["):
            found.add(target[8:-1])
    return found


def _address(hex_addr: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """/proc/net/tcp's address: 32-bit words in host (little-endian) order."""
    raw = bytes.fromhex(hex_addr)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return ipaddress.ip_address(words)


def listening(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket `pid` listens on."""
    mine, found = _inodes(pid), []
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            next(f)
            for line in f:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in mine:           # LISTEN
                    addr, port = cols[1].split(":")
                    found.append((str(_address(addr)), int(port, 16)))
    return found


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def reach(address: str) -> str:
    """Where a client reaches a socket bound to `address` (a wildcard: loopback)."""
    return "127.0.0.1" if address in ("0.0.0.0", "::") else address


def host_addresses() -> list[str]:
    """This host's own addresses other than loopback (may be none)."""
    try:
        infos = socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)
    except OSError:
        return []
    return sorted({i[4][0] for i in infos if not is_loopback(i[4][0])})
