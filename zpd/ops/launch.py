"""`zpd launch`: a whole cluster on this host, router plus N prefill and K decode workers.

Each worker binds a free port and reports it through a ready file; the router is
started once all workers are up; the launcher writes the cluster's ready file and
stops every child on SIGINT/SIGTERM.
"""
from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson

from zpd.config import HttpConfig, default_of
from zpd.env import http_child_environ
from zpd.ops.exposure import given_http_keys
from zpd.ops.http_options import HTTP_PASSTHROUGH
from zpd.ops.options import passthrough_argv, router_argv
from zpd.ops.ready import write_ready_file
from zpd.wire.router_proof import write_router_secret

log = logging.getLogger("zpd.ops.launch")


def split_cores(cores: list[int], workers: list[str], explicit: dict[str, int | None],
                bind: bool) -> list[tuple[int, list[int] | None]]:
    """(torch threads, CPUs to bind or None) for each local worker, in order. Workers
    whose role has no explicit thread count share the cores the others leave: each
    gets an equal whole number of them (at least one), and with `bind`, while there
    are enough, its own disjoint set, so no worker's OpenMP threads wait on another's.
    A worker with an explicit count is not bound (its threads may exceed its share)."""
    taken = sum(explicit[r] for r in workers if explicit[r])
    auto = [r for r in workers if not explicit[r]]
    share = max(1, (len(cores) - taken) // len(auto)) if auto else 0
    free, plan = iter(cores[taken:] if taken + share * len(auto) <= len(cores) else ()), []
    for role in workers:
        if explicit[role]:
            plan.append((explicit[role], None))
            continue
        own = [c for _, c in zip(range(share), free)]
        plan.append((share, own if bind and len(own) == share else None))
    return plan


class Child:
    def __init__(self, role: str, argv: list[str], ready: Path, log_file: Path | None,
                 env: dict[str, str] | None = None, cpus: list[int] | None = None) -> None:
        self.role, self.ready = role, ready
        out = open(log_file, "ab") if log_file else None
        self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT if out else None,
                                     start_new_session=True, env=env,
                                     preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)
        if out:
            out.close()
        self.info: dict | None = None
        self.reported = False

    def poll_ready(self) -> bool:
        if self.info is None and self.ready.exists():
            self.info = orjson.loads(self.ready.read_bytes())
        return self.info is not None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()


def _wait_ready(children: list[Child], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not all(c.poll_ready() for c in children):
        for c in children:
            if c.proc.poll() is not None:
                raise RuntimeError(f"{c.role} worker exited with code {c.proc.returncode} before "
                                   "it was ready (see its log above)")
        if time.monotonic() > deadline:
            raise RuntimeError(f"workers not ready within {timeout:.0f} s")
        time.sleep(0.05)


def weights_timeout(weight_sync_timeout: float) -> float:
    """The front's --weights-timeout: long enough that the workers' --weight-sync-timeout
    (of which the router gives them 0.9: zpd/router/weights/sync.WORKER_SHARE) ends a
    stalled push first, with its reason."""
    return max(default_of(HttpConfig, "weights_timeout"), weight_sync_timeout / 0.9 + 5.0)


def _start_http(args, py: list[str], router: str, tmp: Path, log_dir: Path | None) -> Child:
    """`zpd http` for the cluster; its keys go through its environment, never its argv
    (which every local user can read)."""
    env = http_child_environ(*given_http_keys(args))
    argv = py + ["http", "--router", router, "--model", args.model, "--host", args.host,
                 "--port", str(args.http_port), "--ready-file", str(tmp / "http.json"),
                 "--log-level", args.log_level, "--workers", str(args.http_workers),
                 "--weights-timeout", f"{weights_timeout(args.weight_sync_timeout):g}"] \
        + passthrough_argv(args, HTTP_PASSTHROUGH) \
        + (["--curve-keys", args.curve_keys] if args.curve_keys else []) \
        + (["--insecure"] if args.insecure else [])
    return Child("http", argv, tmp / "http.json", log_dir / "http.log" if log_dir else None, env)


def _start_routers(args, py: list[str], eps: dict[str, str], tmp: Path,
                   log_dir: Path | None) -> list[Child]:
    """--routers N: the first on --port coordinates, the others (on the ports after it,
    or any free ones with --port 0) follow it (zpd/router/ha/peers.py)."""
    routers: list[Child] = []
    for i in range(args.routers):
        port = args.port + i if args.port else 0
        follow = ["--coordinator", routers[0].info["endpoint"]] if routers else []
        name = "router" if i == 0 else f"router{i}"
        routers.append(Child("router", py + [
            "router", "--host", args.host, "--port", str(port), "--prefill", eps["prefill"],
            "--decode", eps["decode"], "--ready-file", str(tmp / f"{name}.json"),
            "--log-level", args.log_level, "--heartbeat", str(args.heartbeat),
            "--peer-timeout", str(args.peer_timeout)] + follow
            + (["--curve-keys", args.curve_keys] if args.curve_keys else [])
            + ["--router-secret-file", args.router_secret_file]
            + (["--insecure"] if args.insecure else []) + router_argv(args),
            tmp / f"{name}.json", log_dir / f"{name}.log" if log_dir else None))
        _wait_ready(routers[-1:], args.startup_timeout)
    return routers


def launch(args, worker_flags: list[str]) -> int:
    """args: prefill, decode, host, port, ready_file, log_dir, startup_timeout."""
    tmp = Path(tempfile.mkdtemp(prefix="zpd-launch-"))
    log_dir = Path(args.log_dir) if args.log_dir else None
    if log_dir:
        log_dir.mkdir(parents=True, exist_ok=True)
    py = [sys.executable, "-m", "zpd"]
    if args.router_secret_file is None:      # the routers prove themselves with it
        args.router_secret_file = str(write_router_secret(tmp / "router.secret"))
        worker_flags = worker_flags + ["--router-secret-file", args.router_secret_file]
    children: list[Child] = []
    stopping = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopping.append(True))
    try:
        roles = ["prefill"] * args.prefill + ["decode"] * args.decode
        explicit = {r: getattr(args, f"{r}_threads", None) or args.threads for r in ("prefill", "decode")}
        plan = split_cores(sorted(os.sched_getaffinity(0)), roles, explicit, args.cpu_bind)
        for i, (role, (threads, cpus)) in enumerate(zip(roles, plan)):
            n = i if role == "prefill" else i - args.prefill
            ready = tmp / f"{role}{n}.json"
            tp = getattr(args, f"{role}_tp") or args.tp
            ep = getattr(args, f"{role}_ep") or args.ep
            argv = py + [role, "--host", args.host, "--port", "0", "--ready-file", str(ready)] \
                + worker_flags + ["--threads", str(threads), "--tp", str(tp), "--ep", str(ep)]
            log.warning("%s worker %d: %d torch thread(s)%s", role, n, threads,
                     f", bound to CPUs {','.join(map(str, cpus))}" if cpus else "")
            children.append(Child(role, argv, ready, log_dir / f"{role}{n}.log" if log_dir else None,
                                  cpus=cpus))
        _wait_ready(children, args.startup_timeout)
        eps = {r: ",".join(c.info["endpoint"] for c in children if c.role == r)
               for r in ("prefill", "decode")}
        routers = _start_routers(args, py, eps, tmp, log_dir)
        children += routers
        router = routers[0]
        cluster = {"router": router.info["endpoint"],
                   "routers": [r.info["endpoint"] for r in routers],
                   "workers": [{"role": c.role, "endpoint": c.info["endpoint"], "pid": c.proc.pid}
                               for c in children if c.role in ("prefill", "decode")]}
        if args.http_port is not None:
            http = _start_http(args, py, ",".join(cluster["routers"]), tmp, log_dir)
            children.append(http)
            _wait_ready([http], args.startup_timeout)
            cluster["http"] = http.info["endpoint"]
        write_ready_file(args.ready_file, cluster)
        http = f", HTTP http://{cluster['http']}" if "http" in cluster else ""
        names = "routers " + ", ".join(cluster["routers"]) if len(routers) > 1 else \
            f"router {cluster['router']}"
        print(f"zpd cluster ready: {names} "
              f"({args.prefill} prefill, {args.decode} decode){http}; Ctrl-C stops it", flush=True)
        while not stopping:
            for router in routers:
                if router.proc.poll() is not None:
                    log.error("router %s exited with code %s; stopping the cluster",
                              router.info["endpoint"], router.proc.returncode)
                    return 1
            for c in children:
                if c.proc.poll() is not None and not c.reported:
                    c.reported = True
                    log.error("%s worker %s exited with code %s", c.role, c.info["endpoint"],
                              c.proc.returncode)
            time.sleep(0.2)
        return 0
    except RuntimeError as e:
        print(f"zpd launch: error: {e}", file=sys.stderr)
        return 1
    finally:
        for c in children:
            c.stop()
        deadline = time.monotonic() + 10
        for c in children:
            try:
                c.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                c.proc.kill()
                c.proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)
