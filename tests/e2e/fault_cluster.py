"""Clusters of separate `zpd prefill|decode|router` processes that a test can kill,
freeze, thaw and restart one by one (each on its own port, with its own environment).

Unlike `zpd launch` (tests/e2e/cluster.py), nothing here stops the others when one
process dies, which is what fault tests need: the workers must outlive the router."""
from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import orjson

from tests.e2e.cluster import ROOT, zpd_cmd
from zpd.client import Client, assemble
from zpd.wire.router_proof import write_router_secret
from zpd.wire.security import client_curve

# Short deadlines keep the fault suite fast: 504s come after KV_WAIT seconds, a fence
# is released at the latest TRANSFER + 5 s after it was set.
TRANSFER, KV_WAIT = 2.0, 3.0
FAST = ("--transfer-timeout", str(TRANSFER), "--kv-wait-timeout", str(KV_WAIT))


class Proc:
    """One zpd process; `endpoint` is where it listens (kept across restarts)."""

    def __init__(self, role: str, argv: list[str], env: dict, tmp: Path, name: str) -> None:
        self.role, self.argv, self.env, self.tmp, self.name = role, argv, env, tmp, name
        self.endpoint = ""
        self.proc: subprocess.Popen | None = None
        self.log = tmp / f"{name}.log"
        self.ready = tmp / f"{name}.json"
        self.frozen = False

    def start(self, port: int = 0) -> None:
        self.ready.unlink(missing_ok=True)
        argv = self.argv + ["--port", str(port), "--ready-file", str(self.ready)]
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                         env=os.environ | self.env, start_new_session=True)

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.ready.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} did not start:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.05)
        self.endpoint = orjson.loads(self.ready.read_bytes())["endpoint"]

    @property
    def port(self) -> int:
        return int(self.endpoint.rpartition(":")[2])

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def alive(self) -> bool:
        """Running and not frozen: it can answer."""
        return self.proc is not None and self.proc.poll() is None and not self.frozen

    def signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)
        self.frozen = sig == signal.SIGSTOP or (self.frozen and sig != signal.SIGCONT)

    def kill(self) -> None:
        """kill -9, and reap it."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.frozen = False

    def restart(self) -> None:
        """A new process on the same port."""
        self.kill()
        self.start(self.port)
        self.wait_ready()

    def terminate(self) -> None:
        """Ask it to stop (SIGTERM); `stop` waits for it."""
        if self.proc is None or self.proc.poll() is not None:
            return
        if self.frozen:
            self.signal(signal.SIGCONT)
        self.proc.terminate()

    def stop(self) -> None:
        self.terminate()
        if self.proc is None:
            return
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class FaultCluster:
    """Prefill and decode workers plus a router, each its own process.

    `prefill_env`/`decode_env`: extra environment per role (ZPD_TRANSPORT_FAULT,
    ZPD_DROP_MESSAGES); `flags`: extra flags for every worker."""

    def __init__(self, tmp: Path, *, prefill: int = 1, decode: int = 1, dtype: str = "float64",
                 flags: tuple[str, ...] = FAST, prefill_flags: tuple[str, ...] = (),
                 decode_flags: tuple[str, ...] = (), prefill_env: dict | None = None,
                 decode_env: dict | None = None, wait: bool = True,
                 curve_keys: Path | None = None) -> None:
        self.tmp = tmp
        # what `zpd launch` hands its processes: the routers prove themselves with it
        self.security_flags = ("--router-secret-file", str(write_router_secret(tmp / "router.secret")))
        if curve_keys is not None:
            self.security_flags += ("--curve-keys", str(curve_keys))
        # its own clients (status, tests) connect with the admin key
        self.curve = None if curve_keys is None else client_curve(curve_keys, "admin")
        common = ["--model", "tiny", "--dtype", dtype, "--threads", "1", "--kv-cache-mb", "4",
                  "--log-level", "INFO", *self.security_flags, *flags]
        self.prefills = [Proc("prefill", zpd_cmd("prefill", *common, *prefill_flags),
                              prefill_env or {}, tmp, f"prefill{i}") for i in range(prefill)]
        self.decodes = [Proc("decode", zpd_cmd("decode", *common, *decode_flags),
                             decode_env or {}, tmp, f"decode{i}") for i in range(decode)]
        self.router: Proc | None = None
        for w in self.workers:
            w.start()
        if wait:
            self.wait()

    def wait(self) -> "FaultCluster":
        """Until every worker and the router are ready (start several clusters, then wait)."""
        try:
            for w in self.workers:
                w.wait_ready()
            self.start_router()
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def workers(self) -> list[Proc]:
        return self.prefills + self.decodes

    def start_router(self) -> None:
        """A (new) router for the same workers, on a new port."""
        argv = zpd_cmd("router", "--prefill", ",".join(w.endpoint for w in self.prefills),
                       "--decode", ",".join(w.endpoint for w in self.decodes),
                       "--log-level", "INFO", *self.security_flags)
        n = len([p for p in self.tmp.glob("router*.json")])
        self.router = Proc("router", argv, {}, self.tmp, f"router{n}")
        self.router.start()
        self.router.wait_ready()

    def client(self, timeout: float = 60.0) -> Client:
        return Client(self.router.endpoint, timeout=timeout, curve=self.curve)

    def worker_status(self, worker: Proc, timeout: float = 10.0) -> dict:
        with Client(worker.endpoint, timeout=timeout, curve=self.curve) as c:
            reply = c.admin("status", timeout=timeout)
        assert reply["ok"], reply
        return reply

    def wait_all_free(self, workers: list[Proc] | None = None, timeout: float = 15.0) -> float:
        """Wait until every (given) worker has all pages free; checks the page invariant
        on every status seen. Returns the seconds it took."""
        started = time.monotonic()
        for w in workers or [w for w in self.workers if w.alive]:
            while True:
                pages = self.worker_status(w)["kv_pages"]
                assert pages["free"] + pages["held"] + pages["fenced"] + pages["cached"] == \
                    pages["total"], (w.name, pages)
                if pages["free"] + pages["cached"] == pages["total"]:
                    break
                assert time.monotonic() - started < timeout, f"{w.name} pages not free: {pages}"
                time.sleep(0.1)
        return time.monotonic() - started

    def logs(self) -> str:
        return "\n".join(f"==== {p.name}\n{p.log.read_text()[-6000:]}"
                         for p in self.workers + [self.router] if p is not None and p.log.exists())

    def procs(self) -> list[Proc]:
        return ([self.router] if self.router else []) + self.workers

    def stop(self) -> None:
        for p in self.procs():          # all at once: each takes a moment to shut down
            p.terminate()
        for p in self.procs():
            p.stop()

    def __enter__(self) -> "FaultCluster":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class ClientReader:
    """A thread that reads one client's answers (`thread`, watching `stopping`). `stop`
    ends it, so that the client may be used or closed; `with` stops it however the
    block ends."""

    def __init__(self) -> None:
        self.stopping = threading.Event()
        self.thread: threading.Thread | None = None

    def stop(self) -> None:
        """Stop the reader; again (or before it started) does nothing."""
        self.stopping.set()
        if self.thread is None:
            return
        self.thread.join(5)
        assert not self.thread.is_alive(), "the reader did not stop: its client must stay open"

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class Requests(ClientReader):
    """Requests submitted on one client, whose answers a thread collects with the time
    each one ended. The client belongs to the thread: abort through another client, and
    close it only after `stop` (use `with submit(...) as reqs` inside the client's own
    `with`): a zmq socket closed under a thread still reading it is undefined behaviour,
    and once left a context that hung the rest of the test run."""

    POLL = 0.2      # seconds the reader waits for a chunk before it looks at `stopping`

    def __init__(self, client: Client) -> None:
        super().__init__()
        self.client = client
        self.chunks: dict[str, list[dict]] = {}
        self.done: dict[str, dict] = {}
        self.ended_at: dict[str, float] = {}
        self.lock = threading.Lock()

    def submit(self, rid: str, input_ids: list[int], max_new: int, stream: bool = False) -> str:
        assert self.thread is None, "submit everything before start()"
        self.chunks[rid] = []
        self.client.submit(input_ids=input_ids, rid=rid, stream=stream,
                           sampling_params={"temperature": 0, "max_new_tokens": max_new,
                                            "ignore_eos": True})
        return rid

    def start(self) -> "Requests":
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def _run(self) -> None:
        quiet_since = time.monotonic()
        while len(self.done) < len(self.chunks) and not self.stopping.is_set():
            try:
                chunk = self.client.receive(timeout=self.POLL)
            except TimeoutError:
                if time.monotonic() - quiet_since > 60:
                    return
                continue
            quiet_since = time.monotonic()
            with self.lock:
                self.chunks[chunk["rid"]].append(chunk)
                if chunk["finished"]:
                    self.done[chunk["rid"]] = assemble(self.chunks[chunk["rid"]])
                    self.ended_at[chunk["rid"]] = time.monotonic()

    def tokens(self, rid: str) -> int:
        with self.lock:
            return sum(len(c["token_ids"]) for c in self.chunks[rid])

    def wait(self, timeout: float = 60.0) -> dict[str, dict]:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"only {len(self.done)}/{len(self.chunks)} ended"
        assert len(self.done) == len(self.chunks), f"{len(self.done)}/{len(self.chunks)} ended"
        return self.done


def wait_for(predicate, timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.03)
