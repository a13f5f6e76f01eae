"""Refuse to serve unauthenticated on a network address.

Without `--curve-keys` anyone who reaches a port may send admin commands
(update_weights, release_memory, pause) and requests, so a process that binds
anything but loopback must either have keys or be told `--insecure` explicitly.
Every command that binds (or starts children that bind) calls `check_bind`
before anything binds."""
from __future__ import annotations

import ipaddress
import logging
import socket

log = logging.getLogger("zpd.ops.exposure")

INPROC = "inproc://"     # in-process sockets (tests): reachable from this process only


class ExposureError(ValueError):
    """A non-loopback bind without keys or --insecure (a ValueError: the CLI exits 2)."""


def is_loopback(host: str) -> bool:
    """Whether binding `host` is reachable from this machine only: every address it
    resolves to is in 127.0.0.0/8 or is ::1. Wildcards ("0.0.0.0", "::", "*") and
    names that do not resolve count as reachable from the network."""
    if host.startswith(INPROC):
        return True
    addrs = _addresses(host.strip("[]"))
    return bool(addrs) and all(_loopback_address(a) for a in addrs)


def _addresses(host: str) -> list[str]:
    """The addresses `host` names: itself if it is one, else what it resolves to."""
    try:
        ipaddress.ip_address(host)
        return [host]
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (socket.gaierror, UnicodeError, OSError):
        return []
    return [info[4][0] for info in infos]


def _loopback_address(text: str) -> bool:
    try:
        addr = ipaddress.ip_address(text)
    except ValueError:
        return False
    mapped = getattr(addr, "ipv4_mapped", None)      # ::ffff:127.0.0.1 is 127.0.0.1
    return (mapped or addr).is_loopback


def check_bind(command: str, host: str, curve_keys: str | None, insecure: bool) -> None:
    """Raise ExposureError if `command` would bind `host` on the network without
    authentication and was not given --insecure; with --insecure, log a warning."""
    if curve_keys or is_loopback(host):
        return
    if insecure:
        log.warning("zpd %s binds %s without authentication (--insecure): anyone who can reach "
                    "it may submit requests and send admin commands; use --curve-keys on a "
                    "network you do not fully trust", command, host)
        return
    raise ExposureError(
        f"refusing to bind {host!r}: it is not a loopback address and --curve-keys is not "
        "given, so anyone who can reach its port could send admin commands (update_weights, "
        "release_memory, pause) and requests. Either pass --curve-keys DIR (make the keys "
        "with `zpd keys DIR`), or pass --insecure to run without authentication on a network "
        "you trust")


def check_http_bind(host: str, api_key: str | None, insecure: bool) -> None:
    """Like `check_bind` for the HTTP server, whose authentication is its API key."""
    if api_key or is_loopback(host):
        return
    if insecure:
        log.warning("zpd http binds %s without --api-key (--insecure): anyone who can reach "
                    "it may generate and run the admin routes", host)
        return
    raise ExposureError(
        f"refusing to serve HTTP on {host!r}: it is not a loopback address and --api-key is "
        "not given, so anyone who can reach its port could generate and use the admin routes "
        "(pause, update weights, abort). Pass --api-key KEY (and --admin-api-key for the "
        "admin routes), or --insecure to serve without a key on a network you trust")
