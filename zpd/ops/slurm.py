"""`zpd slurm`: a whole cluster inside a Slurm job (scripts/slurm/zpd.sbatch runs it as
the batch script). Routers and the HTTP front on the allocation's first node, workers
on the others, each process an `srun --exact` step; keys, secret, ready files and one
log per step in the job's directory; dead steps started again on their ports."""
from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
import time
from pathlib import Path

from zpd.client import Client
from zpd.config import LaunchConfig, default_of
from zpd.env import http_child_environ, slurm_job
from zpd.ops.exposure import check_admin_key, check_bind, check_http_bind, given_http_keys
from zpd.ops.http_options import HTTP_PASSTHROUGH
from zpd.ops.launch import weights_timeout
from zpd.ops.options import passthrough_argv, router_argv, worker_argv
from zpd.ops.ready import write_ready_file
from zpd.ops.slurm_nodes import (Node, allocation, control_cpus, ib_devices, place, step_cpus,
                                 step_mem_per_cpu)
from zpd.ops.slurm_steps import CLEAN_EXITS, Step, stop_steps, wait_ready
from zpd.wire.router_proof import write_router_secret
from zpd.wire.security import client_curve, create_keys

log = logging.getLogger("zpd.ops.slurm")

HTTP_PORT = 30000          # SGLang's; `--http-port 0` takes any free one
STOP_SECONDS = 10.0        # SIGTERM to SIGKILL for the steps: within Slurm's KillWait


def job_dir(args: argparse.Namespace, env: dict[str, str]) -> Path:
    """The job's directory: keys, secret, ready files, logs (made private)."""
    submit = Path(env.get("SLURM_SUBMIT_DIR", "."))
    path = Path(args.job_dir or submit / f"zpd-{env['SLURM_JOB_ID']}")
    for sub in ("", "ready", "logs"):
        (path / sub).mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


def security(args: argparse.Namespace, root: Path) -> None:
    """CURVE keys made once into the job's directory (unless given, or --insecure) and
    the routers' secret: every step reads them there, none gets them on its command line."""
    if args.curve_keys is None and not args.insecure:
        keys = root / "keys"
        if not (keys / "server.key").exists():
            create_keys(keys)
        args.curve_keys = str(keys)
    if args.router_secret_file is None:
        secret = root / "router.secret"
        if not secret.exists():
            write_router_secret(secret)
        args.router_secret_file = str(secret)


def worker_steps(args: argparse.Namespace, nodes: list[Node], root: Path) -> list[Step]:
    roles = ["prefill"] * args.prefill + ["decode"] * args.decode
    where = place(len(nodes), len(roles))
    per_node = {i: where.count(i) for i in set(where)}
    devices = ib_devices(args.ib_device_map, [n.name for n in nodes])
    base = worker_argv(args)
    steps = []
    for i, (role, at) in enumerate(zip(roles, where)):
        node = nodes[at]
        kept = control_cpus(args.routers, node.cpus, per_node[0]) if at == 0 else 0
        cpus = step_cpus(node.cpus - kept, per_node[at])
        threads = getattr(args, f"{role}_threads") or args.threads or cpus
        tp = getattr(args, f"{role}_tp") or args.tp
        ep = getattr(args, f"{role}_ep") or args.ep
        argv = ["--host", node.addr, *base, "--threads", str(threads), "--tp", str(tp),
                "--ep", str(ep)]
        if node.name in devices:
            argv += ["--ib-device", devices[node.name]]
        n = i if role == "prefill" else i - args.prefill
        steps.append(Step(f"{role}{n}", role, node, cpus, argv, root,
                          gpus=tp if args.device.startswith("cuda") else 0))
    return steps


def router_steps(args: argparse.Namespace, node: Node, workers: list[Step],
                 root: Path) -> list[Step]:
    eps = {r: ",".join(w.endpoint for w in workers if w.role == r) for r in ("prefill", "decode")}
    common = ["--host", node.addr, "--prefill", eps["prefill"], "--decode", eps["decode"],
              "--log-level", args.log_level, "--heartbeat", str(args.heartbeat),
              "--peer-timeout", str(args.peer_timeout),
              "--router-secret-file", args.router_secret_file] \
        + (["--curve-keys", args.curve_keys] if args.curve_keys else []) \
        + (["--insecure"] if args.insecure else []) + router_argv(args)
    overlap = not control_cpus(args.routers, node.cpus, sum(w.node == node for w in workers))
    return [Step("router" if i == 0 else f"router{i}", "router", node, 1, list(common), root,
                 port=args.port + i if args.port else 0, overlap=overlap)
            for i in range(args.routers)]


def http_step(args: argparse.Namespace, node: Node, routers: list[Step], root: Path) -> Step:
    argv = ["--router", ",".join(r.endpoint for r in routers), "--model", args.model,
            "--host", node.addr, "--log-level", args.log_level,
            "--workers", str(args.http_workers),
            "--weights-timeout", f"{weights_timeout(args.weight_sync_timeout):g}"] \
        + passthrough_argv(args, HTTP_PASSTHROUGH) \
        + (["--curve-keys", args.curve_keys] if args.curve_keys else []) \
        + (["--insecure"] if args.insecure else [])
    port = HTTP_PORT if args.http_port is None else args.http_port
    # its API keys travel in its environment, never on its command line
    return Step("http", "http", node, 1, argv, root, port=port, overlap=routers[0].overlap,
                env=http_child_environ(*given_http_keys(args)))


class Supervisor:
    """Starts the cluster's steps, then watches them until SIGTERM (scancel) or a loss
    the cluster cannot serve without (a router or the front given up, or every worker
    of a role)."""

    def __init__(self, args: argparse.Namespace, root: Path, address_file: Path,
                 job: dict[str, str]) -> None:
        """`job`: the job's SLURM_* variables (zpd.env.slurm_job)."""
        self.args, self.root, self.address_file, self.job = args, root, address_file, job
        self.steps: list[Step] = []
        self.stopping = False

    def stop_on_signals(self) -> None:
        """SIGTERM (scancel) and SIGINT stop the cluster, whatever it is doing."""
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, *_: object) -> None:
        self.stopping = True

    def start(self, nodes: list[Node]) -> dict:
        args, t0 = self.args, time.monotonic()
        workers = worker_steps(args, nodes, self.root)
        self._start(workers)
        routers = router_steps(args, nodes[0], workers, self.root)
        for r in routers:       # the first coordinates; the others follow it
            if r is not routers[0]:
                r.argv += ["--coordinator", routers[0].endpoint]
            self._start([r])
        front = http_step(args, nodes[0], routers, self.root)
        self._start([front])
        addresses = {"http": f"http://{front.endpoint}", "router": f"tcp://{routers[0].endpoint}",
                     "routers": [f"tcp://{r.endpoint}" for r in routers],
                     "curve_keys": args.curve_keys, "job_dir": str(self.root),
                     "job_id": self.job["SLURM_JOB_ID"],
                     "workers": [{"name": w.name, "role": w.role, "node": w.node.name,
                                  "endpoint": w.endpoint} for w in workers]}
        write_ready_file(self.address_file, addresses)
        log.warning("zpd cluster ready in %.1f s: %s", time.monotonic() - t0, addresses)
        return addresses

    def _start(self, steps: list[Step]) -> None:
        self.steps += steps
        for s in steps:
            s.mem_per_cpu = step_mem_per_cpu(self.job, s.node)
            s.start()
        wait_ready(steps, self.args.startup_timeout, lambda: self.stopping)
        for s in steps:
            log.warning("%s ready on %s at %s", s.name, s.node.name, s.endpoint)

    def watch(self) -> int:
        """Until SIGTERM: restarts dead steps; the exit code: 0 when every step ended
        cleanly at the stop and none was given up, else 1."""
        lost = None
        while not self.stopping and lost is None:
            now = time.monotonic()
            for s in self.steps:
                self._tend(s, now)
            lost = self._lost()
            time.sleep(0.1)
        if lost:
            log.error("%s: stopping the cluster", lost)
        # the front first, then the routers: no request is routed to a stopping worker
        order = sorted(self.steps, key=lambda s: ("http", "router").index(s.role)
                       if s.role in ("http", "router") else 2)
        codes = stop_steps(order, STOP_SECONDS)
        self.address_file.unlink(missing_ok=True)
        unclean = {n: c for n, c in codes.items() if c is not None and c not in CLEAN_EXITS}
        restarts = {s.name: s.restarts for s in self.steps if s.restarts}
        log.warning("zpd cluster stopped: exit codes %s; restarts %s", codes, restarts or "none")
        return 1 if lost or unclean or any(s.gave_up for s in self.steps) else 0

    def _tend(self, s: Step, now: float) -> None:
        if s.gave_up:
            return
        if s.due is not None:
            if now >= s.due:
                s.restarts += 1
                s.start()
            return
        if s.info is None and s.running() and s.poll_ready():
            log.warning("%s back on %s at %s after %.1f s", s.name, s.node.name, s.endpoint,
                        now - s.started)
            if s.role in ("prefill", "decode"):
                threading.Thread(target=check_weights, args=(s, self.steps, self.args.curve_keys),
                                 daemon=True).start()
        if s.info is None and s.running() and not s.hurried and \
                now - s.started > self.args.startup_timeout:
            s.hurried = True       # its exit is then a death like any other
            log.error("%s on %s not ready %.0f s after its start: stopping it", s.name,
                      s.node.name, self.args.startup_timeout)
            s.signal(signal.SIGTERM)
        code = s.exited()
        if code is None:
            return
        s.exits.append(code)
        if s.restarts >= self.args.max_restarts:
            s.gave_up = True
            log.error("%s on %s exited with code %s; given up after %d restarts (log %s)",
                      s.name, s.node.name, code, s.restarts, s.log_file)
            return
        wait = self.args.restart_backoff * 2 ** s.restarts
        s.due, s.proc = now + wait, None
        log.error("%s on %s (%s) exited with code %s; starting it again in %.1f s (log %s)",
                  s.name, s.node.name, s.endpoint, code, wait, s.log_file)

    def _lost(self) -> str | None:
        for s in self.steps:
            if s.gave_up and s.role in ("router", "http"):
                return f"{s.name} given up"
        for role in ("prefill", "decode"):
            mine = [s for s in self.steps if s.role == role]
            if mine and all(s.gave_up for s in mine):
                return f"every {role} worker given up"
        return None


def check_weights(step: Step, steps: list[Step], keys: str | None) -> None:
    """A worker started again loads --model: after an update_weights it holds other
    weights than the cluster's, and its tokens say so (their weight version). Compare it
    with the others (the router's status) and name it in the job's log."""
    router = next(s for s in steps if s.role == "router")
    try:
        with Client(router.endpoint, timeout=10,
                    curve=client_curve(keys, "admin") if keys else None) as client:
            for _ in range(20):     # until the router hears it again
                workers = [w for w in client.admin("status", timeout=5).get("workers", [])
                           if w.get("ok")]
                mine = [w for w in workers if w.get("endpoint") == step.endpoint]
                if mine:
                    break
                time.sleep(0.5)
            else:
                raise TimeoutError("the router does not reach it")
    except Exception as e:     # a check in a thread of its own: said, never raised
        log.warning("could not compare %s's weights with the cluster's: %s", step.name, e)
        return
    theirs = {w.get("weight_version") for w in workers if w.get("endpoint") != step.endpoint}
    if theirs and mine[0].get("weight_version") not in theirs:
        log.error("%s came back with weights %r (its --model) while the cluster serves %s: "
                  "update it (zpd admin --endpoint %s update-weights --path ...)", step.name,
                  mine[0].get("weight_version"), ", ".join(map(repr, sorted(theirs))),
                  step.endpoint)


def run_slurm(args: argparse.Namespace) -> int:
    env = slurm_job()
    nodes = allocation(env)
    root = job_dir(args, env)
    handler = logging.FileHandler(root / "logs" / "job.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.getLogger().addHandler(handler)
    security(args, root)
    for node in nodes:       # refused here, by name, before any step starts
        check_bind("slurm", node.addr, args.curve_keys, args.insecure)
    api_key, admin_key = given_http_keys(args)
    check_http_bind(nodes[0].addr, api_key, args.insecure)
    check_admin_key(admin_key, args.curve_keys, args.insecure)
    if args.host != default_of(LaunchConfig, "host"):
        raise ValueError("--host: under Slurm each process binds its node's NodeAddr")
    if args.log_dir is not None:
        raise ValueError("--log-dir: under Slurm each step logs to JOB_DIR/logs (--job-dir)")
    address_file = Path(args.ready_file or Path(env.get("SLURM_SUBMIT_DIR", ".")) /
                        f"zpd-{env['SLURM_JOB_ID']}.json")
    sup = Supervisor(args, root, address_file, env)
    sup.stop_on_signals()
    try:
        sup.start(nodes)
    except RuntimeError as e:
        print(f"zpd slurm: error: {e}", file=sys.stderr, flush=True)
        stop_steps(sup.steps, STOP_SECONDS)
        return 1
    print(f"zpd cluster of job {env['SLURM_JOB_ID']}: {address_file}", flush=True)
    print(address_file.read_text(), flush=True)
    return sup.watch()
