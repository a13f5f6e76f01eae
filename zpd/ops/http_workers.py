"""`zpd http --workers N`: N HTTP front processes on one host:port (issue 34, item 3).

One Python process tops out at one core of JSON, SSE and text work; N processes share
the port with SO_REUSEPORT, the kernel spreading connections over them. This parent
reserves the port (bound, never listening, so it takes no connection; port 0 picks
one for all), forks the N fronts before anything else starts (no thread, no socket, no
tokenizer yet), writes the ready file once every front has written its own, forwards
SIGINT/SIGTERM and waits for them. Each front is a whole `zpd http`: its own router
connections, tokenizer and tables (docs/http.md, "Several fronts and routers"); their
/metrics latency histograms are kept in one directory and summed at each scrape.

A front that dies is started again, as a web server's workers are: its streams are
lost (their clients see the connection drop, and the router aborts their requests),
the others keep serving. One that dies before every front is ready, or within
MIN_UPTIME_S of its start (a crash loop, a bad flag), stops them all: the parent then
exits with 1.
"""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

from zpd.config import HttpConfig
from zpd.ops.ready import write_ready_file
from zpd.wire.net import format_endpoint

log = logging.getLogger("zpd.ops.http_workers")

MIN_UPTIME_S = 10.0      # a front dead sooner than this after its start is not restarted
STOP_WAIT_S = 10.0       # SIGTERM, then this long, then SIGKILL
PR_SET_PDEATHSIG = 1


def reserve_port(host: str, port: int) -> socket.socket:
    """A socket bound to host:port with SO_REUSEPORT and never listening: the port is
    ours (port 0: a free one) and every front binds it too."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


class Fronts:
    """The forked fronts: pid -> (index, when started)."""

    def __init__(self, cfg: HttpConfig, port: int, serve: Callable[[HttpConfig], int],
                 tmp: Path) -> None:
        self.cfg, self.port, self.serve, self.tmp = cfg, port, serve, tmp
        self.running: dict[int, tuple[int, float]] = {}
        self.metrics_dir = tmp / "metrics"          # every front's latency histograms
        self.metrics_dir.mkdir()

    def ready_file(self, index: int) -> Path:
        return self.tmp / f"http{index}.json"

    def start(self, index: int) -> None:
        self.ready_file(index).unlink(missing_ok=True)
        parent = os.getpid()
        child = replace(self.cfg, port=self.port, ready_file=str(self.ready_file(index)),
                        metrics_dir=str(self.metrics_dir), front_index=index)
        pid = os.fork()
        if pid == 0:                                # the front: never returns
            rc = 1
            try:
                _die_with_parent(parent)
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                rc = self.serve(child)
            except BaseException:
                log.exception("HTTP front %d failed", index)
            finally:
                logging.shutdown()
                os._exit(rc)
        self.running[pid] = (index, time.monotonic())

    def all_ready(self) -> bool:
        return all(self.ready_file(i).exists() for i, _ in self.running.values())

    def reap(self) -> list[tuple[int, int, float]]:
        """The fronts that ended since the last call: (index, exit code, uptime)."""
        ended = []
        while self.running:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            if pid in self.running:
                index, started = self.running.pop(pid)
                ended.append((index, os.waitstatus_to_exitcode(status),
                              time.monotonic() - started))
        return ended

    def stop(self) -> None:
        """SIGTERM every front, SIGKILL those still up after STOP_WAIT_S."""
        for pid in self.running:
            _signal(pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_WAIT_S
        while self.running and time.monotonic() < deadline:
            self.reap()
            time.sleep(0.05)
        for pid in self.running:
            _signal(pid, signal.SIGKILL)
        while self.running:
            pid, _ = os.waitpid(-1, 0)
            self.running.pop(pid, None)


def serve_http_workers(cfg: HttpConfig, serve: Callable[[HttpConfig], int]) -> int:
    """Run `cfg.workers` fronts (each `serve(cfg)` in a forked process) until SIGINT or
    SIGTERM; 1 when one failed to start or crash-looped."""
    stopping: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, _: stopping.append(signum))
    reserved = reserve_port(cfg.host, cfg.port)
    port = reserved.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="zpd-http-") as tmp:
        fronts = Fronts(cfg, port, serve, Path(tmp))
        try:
            for i in range(cfg.workers):
                fronts.start(i)
            return _supervise(cfg, fronts, format_endpoint(cfg.host, port), stopping)
        finally:
            fronts.stop()
            reserved.close()


def _supervise(cfg: HttpConfig, fronts: Fronts, endpoint: str, stopping: list[int],
               poll_s: float = 0.1) -> int:
    ready = False
    while not stopping:
        if not ready and fronts.all_ready():
            ready = True
            write_ready_file(cfg.ready_file, {"role": "http", "endpoint": endpoint,
                                              "pid": os.getpid(), "workers": _pids(fronts)})
            log.warning("zpd http ready on http://%s: %d front processes", endpoint,
                        cfg.workers)
        for index, code, uptime in fronts.reap():
            if not ready or uptime < MIN_UPTIME_S:
                log.error("HTTP front %d exited with code %s %.1f s after its start; stopping "
                          "the others", index, code, uptime)
                return 1
            log.error("HTTP front %d exited with code %s; starting it again", index, code)
            fronts.start(index)
        time.sleep(poll_s)
    return 0


def _pids(fronts: Fronts) -> list[int]:
    return [pid for pid, _ in sorted(fronts.running.items(), key=lambda kv: kv[1][0])]


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _die_with_parent(parent: int) -> None:
    """Linux: this front gets SIGTERM when the parent dies, even by SIGKILL."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass                           # elsewhere: the parent's stop() is the only way
    if os.getppid() != parent:         # it died before the call above
        os._exit(1)

