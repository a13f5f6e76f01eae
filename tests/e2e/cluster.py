"""Start real zpd clusters (router and worker processes on loopback) for tests."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import orjson

from zpd.client import Client

ROOT = Path(__file__).resolve().parents[2]


def zpd_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "zpd", *args]


class Cluster:
    """`zpd launch` in a subprocess; `.router` is its endpoint once started."""

    def __init__(self, tmp: Path, *, prefill: int = 1, decode: int = 1, model: str = "tiny",
                 dtype: str = "float64", extra: tuple[str, ...] = (), env: dict | None = None) -> None:
        self.ready = tmp / f"cluster-{time.monotonic_ns()}.json"
        self.log = tmp / f"launch-{time.monotonic_ns()}.log"
        argv = zpd_cmd("launch", "--model", model, "--dtype", dtype, "--prefill", str(prefill),
                       "--decode", str(decode), "--port", "0", "--ready-file", str(self.ready),
                       "--threads", "1", "--kv-cache-mb", "16", "--log-level", "INFO", *extra)
        self.proc = subprocess.Popen(argv, cwd=ROOT, stdout=open(self.log, "wb"),
                                     stderr=subprocess.STDOUT, env=os.environ | (env or {}),
                                     start_new_session=True)
        self.info = self._wait_ready()
        self.router = self.info["router"]

    def _wait_ready(self, timeout: float = 120.0) -> dict:
        deadline = time.monotonic() + timeout
        while not self.ready.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"cluster did not start:\n{self.log.read_text()[-4000:]}")
            time.sleep(0.1)
        return orjson.loads(self.ready.read_bytes())

    def client(self, timeout: float = 120.0) -> Client:
        return Client(self.router, timeout=timeout)

    def pids(self) -> list[int]:
        return [w["pid"] for w in self.info["workers"]]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def assert_all_pages_free(client: Client) -> dict:
    status = client.admin("status")
    assert status["ok"], status
    for w in status["workers"]:
        pages = w["kv_pages"]
        # idle: every page free, or kept in a prefill's prefix cache for reuse
        assert pages["free"] + pages["cached"] == pages["total"], w
        assert pages["held"] == 0 and pages["fenced"] == 0, w
    return status


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
