"""The processes of bench_control_plane.py: the simulated pool (bench/sim_workers.py),
the real `zpd router` and `zpd http`, each in its own session with its ready file and
its log, and the router of a real `zpd launch` cluster; CPU from /proc."""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import orjson

from common import ROOT, Launch, children, cpu_seconds


class Proc:
    """One process of ours, in its own session, with its ready file read."""

    def __init__(self, argv: list[str], tmp: Path, name: str, stdin: bool = False) -> None:
        self.ready, self.log = tmp / f"{name}.json", tmp / f"{name}.log"
        self.ready.unlink(missing_ok=True)          # a process of an earlier run wrote it
        self.proc = subprocess.Popen(argv + ["--ready-file", str(self.ready)], cwd=ROOT,
                                     stdin=subprocess.PIPE if stdin else None,
                                     stdout=open(self.log, "wb"), stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.monotonic() + 60
        while not self.ready.exists() or not self.ready.stat().st_size:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{name} did not start:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.05)
        self.info = orjson.loads(self.ready.read_bytes())
        self.pid = self.info.get("pid", self.proc.pid)

    def cpu(self) -> float:
        return cpu_seconds(self.pid)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


class SimPool(Proc):
    """bench/sim_workers.py's process."""

    def __init__(self, tmp: Path, decodes: int, prefills: int, args: argparse.Namespace) -> None:
        super().__init__([sys.executable, str(ROOT / "bench" / "sim_workers.py"), "--decode",
                          str(decodes), "--prefill", str(prefills), "--step-ms", str(args.step_ms),
                          "--prefill-us", str(args.prefill_us),
                          "--experts", getattr(args, "experts", "0/0")], tmp, "pool", stdin=True)
        self.tmp = tmp

    def dropped(self) -> int:
        """Sends the pool dropped (read from its log once it has stopped)."""
        found = [line for line in self.log.read_text().splitlines()
                 if line.startswith("dropped sends:")]   # not zpd.wire.net's warnings
        return int(found[-1].split()[-1]) if found else 0

    def stamps(self) -> dict[str, list[float]]:
        """The send times of the streamed tokens since the last call."""
        path = self.tmp / "stamps.json"
        self.proc.stdin.write(f"dump {path}\n".encode())
        self.proc.stdin.flush()
        deadline = time.monotonic() + 10
        while not path.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.05)
        got = orjson.loads(path.read_bytes())
        path.unlink()
        return got


def stop_all(procs: list[Proc], problems: list[str]) -> None:
    """Stop `procs` (the pool first in the list, so last to stop); a pool that dropped
    sends lost tokens, which the figures must not hide."""
    for p in reversed(procs):
        p.stop()
    dropped = procs[0].dropped()
    if dropped:
        problems.append(f"the simulated pool dropped {dropped} sends (a router fell behind)")


def zpd(*args: str, profile: str = "") -> list[str]:
    if profile:      # by the router thread's CPU time (bench/cpu_profile.py)
        return [sys.executable, str(ROOT / "bench" / "cpu_profile.py"), profile, *args]
    return [sys.executable, "-m", "zpd", *args]


def router_argv(prefill: list[str], decode: list[str], flags: list[str], profile: str = "") -> list[str]:
    return zpd("router", "--prefill", ",".join(prefill), "--decode", ",".join(decode),
               "--port", "0", *flags, profile=profile)


def front_argv(router: str) -> list[str]:
    return zpd("http", "--router", router, "--model", "null", "--port", "0",
               "--incremental-streaming-output")


def launch_router_pid(launch: Launch) -> int:
    """The router among `zpd launch`'s children: the one that is no worker (Launch.pids
    keeps one worker per role, and here are several)."""
    workers = {w["pid"] for w in orjson.loads((launch.tmp / "cluster.json").read_bytes())["workers"]}
    (pid,) = [p for p in children(launch.proc.pid) if p not in workers]
    return pid


class RouterPid(Proc):
    def __init__(self, pid: int) -> None:         # a process `zpd launch` started
        self.pid = pid
