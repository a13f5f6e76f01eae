"""What tests/e2e/test_trainer_push.py does to a cluster: its HTTP calls, a trainer
process joined to the workers' group, and what it reads back (versions, the sync
helpers left, the workers' counters)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

from tests.e2e.cluster import ROOT, Cluster
from tests.unit.trainer_side import free_port

GROUP = "weight_update_group"


def post(cluster: Cluster, path: str, body: dict, timeout: float = 120) -> tuple[int, dict]:
    request = urllib.request.Request(f"http://{cluster.info['http']}{path}", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def versions(cluster: Cluster) -> set[str]:
    with urllib.request.urlopen(f"http://{cluster.info['http']}/get_weight_version") as r:
        return set(json.loads(r.read())["weight_versions"].values())


class InThread:
    """One HTTP call on a thread: `.result()` waits for its answer."""

    def __init__(self, fn, *args) -> None:
        self.value = None
        self.thread = threading.Thread(target=lambda: setattr(self, "value", fn(*args)), daemon=True)
        self.thread.start()

    def result(self, timeout: float = 120):
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "no HTTP answer"
        return self.value


class TrainerProc:
    """tests/e2e/trainer_proc.py, joined to the cluster's workers."""

    def __init__(self, cluster: Cluster, *flags: str, world: int | None = None,
                 seed: int = 7) -> None:
        """`world`: the group's size (left out: one rank per worker, and the trainer's)."""
        self.port, world = free_port(), world or len(cluster.info["workers"]) + 1
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.e2e.trainer_proc", str(self.port),
                                      str(world), str(seed), *flags], cwd=ROOT, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        status, answer = post(cluster, "/init_weights_update_group", {     # AReaL's string port
            "master_address": "127.0.0.1", "master_port": str(self.port), "rank_offset": 1,
            "world_size": world, "group_name": GROUP, "backend": "gloo"})
        assert status == 200 and answer["success"], answer
        self.joined = answer
        assert self.proc.stdout.readline().strip() == "joined"

    def push(self) -> None:
        self.proc.stdin.write("push\n")
        self.proc.stdin.flush()

    def wait_for(self, line: str) -> None:
        while (got := self.proc.stdout.readline().strip()) != line:
            assert got, f"the trainer ended before {line!r}"

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def announce(tensors: dict) -> dict:
    return {"names": list(tensors), "dtypes": ["float32"] * len(tensors),
            "shapes": [list(t.shape) for t in tensors.values()], "group_name": GROUP}


def helpers(cluster: Cluster) -> dict[int, list[int]]:
    """Each worker's weight-sync helpers: the children of its forkserver (a child of the
    worker whose command line names multiprocessing's forkserver)."""
    parent = {}
    for stat in os.listdir("/proc"):
        try:
            with open(f"/proc/{stat}/stat") as f:
                parent[int(stat)] = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue

    def forkserver(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                return b"forkserver" in f.read()
        except OSError:
            return False
    servers = {p: ppid for p, ppid in parent.items() if forkserver(p)}
    return {w: sorted(p for p, ppid in parent.items() if servers.get(ppid) == w)
            for w in cluster.pids()}


def no_helpers_left(cluster: Cluster) -> bool:
    end = time.monotonic() + 10
    while any(helpers(cluster).values()):
        if time.monotonic() > end:
            return False
        time.sleep(0.1)
    return True


def generates(cluster: Cluster) -> bool:
    status, got = post(cluster, "/generate", {"input_ids": [1, 2, 3],
                                              "sampling_params": {"max_new_tokens": 4}}, 60)
    return status == 200 and len(got["output_ids"]) == 4


def get_json(cluster: Cluster, path: str) -> dict:
    with urllib.request.urlopen(f"http://{cluster.info['http']}{path}") as r:
        return json.loads(r.read())


def _counters(client, role: str) -> dict[str, dict]:
    return {w["endpoint"]: w["counters"] for w in client.admin("status")["workers"]
            if w["role"] == role}
