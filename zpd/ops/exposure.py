"""Refuse to serve unauthenticated on a network address.

Without `--curve-keys` anyone who reaches a port may send admin commands
(update_weights, release_memory, pause) and requests, so a process that binds
anything but loopback must either have keys or be told `--insecure` explicitly.
Every command that binds (or starts children that bind) calls `check_bind`
before anything binds."""
from __future__ import annotations

import ipaddress
import logging
import os
import socket
import stat
from typing import Mapping

from zpd.env import http_keys

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


def check_admin_key(admin_key: str | None, curve_keys: str | None, insecure: bool) -> None:
    """An admin key guards the admin routes only if nothing else reaches the router's
    admin commands: without --curve-keys any local process may send them to the router
    (or a worker) directly. Refused unless --insecure says that is understood."""
    if not admin_key or curve_keys:
        return
    if insecure:
        log.warning("--admin-api-key without --curve-keys (--insecure): any process on this "
                    "host can send admin commands to the router directly, without the key")
        return
    raise ExposureError(
        "refusing --admin-api-key without --curve-keys: the key guards the HTTP admin routes, "
        "but without CURVE any local process can send the same admin commands (pause, "
        "update weights, abort) to the router or a worker directly and bypass it. Pass "
        "--curve-keys DIR (the cluster's, made with `zpd keys DIR`), or --insecure to accept that")


def given_http_keys(args, environ: Mapping[str, str] | None = None) -> tuple[str | None, str | None]:
    """(API key, admin API key) of `zpd http` or `zpd launch`: from --api-key, else
    --api-key-file, else the environment (zpd/env.py; `environ`: the process's)."""
    env_key, env_admin = http_keys() if environ is None else http_keys(environ)
    return (_key(args.api_key, args.api_key_file, "--api-key") or env_key,
            _key(args.admin_api_key, args.admin_api_key_file, "--admin-api-key") or env_admin)


def _key(value: str | None, path: str | None, flag: str) -> str | None:
    if value and path:
        raise ExposureError(f"give {flag} or {flag}-file, not both")
    return read_key_file(path, flag) if path else value


def read_key_file(path: str, flag: str) -> str:
    """The key in file `path` (its first line, stripped); a warning when every local user
    may read it, an ExposureError when it is missing or empty."""
    try:
        mode = os.stat(path).st_mode
        with open(path, encoding="utf-8") as f:
            key = f.readline().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise ExposureError(f"{flag}-file {path!r}: {e}") from None
    if not key:
        raise ExposureError(f"{flag}-file {path!r} is empty")
    if mode & stat.S_IROTH:
        log.warning("%s-file %s is readable by every local user (chmod o-r it)", flag, path)
    return key
