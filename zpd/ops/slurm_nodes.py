"""The allocation a Slurm job runs in: its nodes, their addresses and CPUs, and which
node each process of the cluster takes (`zpd slurm`, scripts/slurm/zpd.sbatch)."""
from __future__ import annotations

import ipaddress
import re
import socket
import subprocess
from dataclasses import dataclass


@dataclass(frozen=True)
class Node:
    name: str
    addr: str          # Slurm's NodeAddr: what the node's processes bind and announce
    cpus: int          # the job's CPUs on it


def _scontrol(*args: str) -> str:
    out = subprocess.run(["scontrol", *args], capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        raise RuntimeError(f"scontrol {' '.join(args)} failed: {out.stderr.strip()}")
    return out.stdout


def node_addr(text: str, name: str) -> str:
    """NodeAddr from `scontrol show node NAME`'s text (the name itself when absent)."""
    m = re.search(r"\bNodeAddr=(\S+)", text)
    return m.group(1) if m else name


def as_ip(addr: str) -> str:
    """A NodeAddr that names a host, resolved: ZeroMQ binds and Mooncake's sessions
    take addresses."""
    try:
        return str(ipaddress.ip_address(addr))
    except ValueError:
        pass
    try:
        return socket.getaddrinfo(addr, None, type=socket.SOCK_STREAM)[0][4][0]
    except OSError as e:
        raise ValueError(f"NodeAddr {addr!r} does not resolve: {e}") from None


def cpus_per_node(text: str, count: int) -> list[int]:
    """SLURM_JOB_CPUS_PER_NODE ("2(x3)", "4,2(x2)") as one figure per node."""
    out: list[int] = []
    for part in filter(None, text.split(",")):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not m:
            raise ValueError(f"SLURM_JOB_CPUS_PER_NODE={text!r}: not Slurm's format")
        out += [int(m.group(1))] * int(m.group(2) or 1)
    if len(out) != count:
        raise ValueError(f"SLURM_JOB_CPUS_PER_NODE={text!r} names {len(out)} nodes, the job "
                         f"has {count}")
    return out


def allocation(environ: dict[str, str]) -> list[Node]:
    """The job's nodes in Slurm's order, each with its NodeAddr and the job's CPUs there."""
    for var in ("SLURM_JOB_ID", "SLURM_JOB_NODELIST", "SLURM_JOB_CPUS_PER_NODE"):
        if not environ.get(var):
            raise ValueError(f"{var} is not set: run inside a Slurm job "
                             "(sbatch scripts/slurm/zpd.sbatch ...)")
    names = _scontrol("show", "hostnames", environ["SLURM_JOB_NODELIST"]).split()
    cpus = cpus_per_node(environ["SLURM_JOB_CPUS_PER_NODE"], len(names))
    return [Node(n, as_ip(node_addr(_scontrol("show", "node", n), n)), c)
            for n, c in zip(names, cpus)]


def place(nodes: int, workers: int) -> list[int]:
    """The node index of each worker, in order: the routers and HTTP front keep node 0,
    the workers take the nodes after it in turn, and node 0 too when there are fewer
    other nodes than workers (so P+D workers fit P+D nodes); one node serves them all."""
    if nodes == 1:
        return [0] * workers
    order = list(range(1, nodes)) + ([0] if workers >= nodes else [])
    return [order[i % len(order)] for i in range(workers)]


def ib_devices(text: str, nodes: list[str]) -> dict[str, str]:
    """--ib-device-map 'NODE=DEV[,DEV] NODE=DEV': refused by name when a node is not the
    job's or an entry is malformed."""
    out: dict[str, str] = {}
    for entry in text.split():
        name, sep, dev = entry.partition("=")
        if not sep or not name or not dev:
            raise ValueError(f"--ib-device-map: {entry!r} is not NODE=DEVICE")
        if name not in nodes:
            raise ValueError(f"--ib-device-map: node {name!r} is not in the job "
                             f"({', '.join(nodes)})")
        out[name] = dev
    return out


def control_cpus(routers: int, cpus: int, workers: int) -> int:
    """CPUs the routers and the front keep on the first node (of `cpus`, beside
    `workers` workers): one each while the workers still have one each; else none, and
    they overlap the workers' CPUs (a step that asks more CPUs than are free waits for
    them forever)."""
    return routers + 1 if cpus - (routers + 1) >= workers else 0


def step_cpus(node_cpus: int, steps: int) -> int:
    """CPUs for each of `steps` workers sharing a node's `node_cpus` (at least one)."""
    return max(1, node_cpus // max(1, steps))


def step_mem_per_cpu(environ: dict[str, str], node: Node) -> int:
    """MB per CPU for each step on `node`, 0 when the job holds no memory. Where Slurm
    counts memory (CR_*_Memory), a step that names none takes all the job's memory on
    its node, and the next step there waits for it: the router and the front on the
    first node would wait on each other forever. A share per CPU lets them run side by
    side, each worker with memory in proportion to its CPUs."""
    if environ.get("SLURM_MEM_PER_CPU"):
        return int(environ["SLURM_MEM_PER_CPU"])
    if environ.get("SLURM_MEM_PER_NODE"):
        return max(1, int(environ["SLURM_MEM_PER_NODE"]) // max(1, node.cpus))
    return 0
