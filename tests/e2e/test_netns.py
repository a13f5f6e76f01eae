"""Several hosts on one machine: the router, a prefill, a decode and a client each in
its own network namespace with its own address, joined by veth pairs through a
bridge that lives in a namespace of its own (so the host's firewall never sees the
traffic). Real Mooncake over TCP between prefill and decode. Only the addresses
this test creates, and only inside its namespaces, carry traffic."""
from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import orjson
import pytest

from engines.loader import load_model
from engines.sampler import SamplingParams
from tests.e2e.cluster import ROOT, zpd_cmd
from engines.offline import OfflineEngine
from engines.request import Request

pytest.importorskip("mooncake.engine", reason="needs mooncake-transfer-engine(-non-cuda)")

SUBNET = "10.200.7"          # lives only inside this test's namespaces
HOSTS = {"router": 1, "prefill": 2, "decode": 3, "client": 4}
PORT = 5757


def sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=30, check=check)


class Namespaces:
    """Creates the namespaces and links; `close` removes all of them (the veths and
    the bridge go with their namespaces)."""

    def __init__(self) -> None:
        tag = f"zpd{os.getpid()}"
        self.names = {role: f"{tag}-{role}" for role in HOSTS} | {"bridge": f"{tag}-br"}
        self.made: list[str] = []

    def build(self) -> None:
        for ns in self.names.values():
            sh("ip", "netns", "add", ns)
            self.made.append(ns)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        br = self.names["bridge"]
        sh("ip", "-n", br, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", br, "link", "set", "br0", "up")
        for role, last in HOSTS.items():
            ns = self.names[role]
            sh("ip", "-n", br, "link", "add", f"to-{role}", "type", "veth", "peer", "name", "eth0",
               "netns", ns)
            sh("ip", "-n", br, "link", "set", f"to-{role}", "master", "br0", "up")
            sh("ip", "-n", ns, "addr", "add", f"{SUBNET}.{last}/24", "dev", "eth0")
            sh("ip", "-n", ns, "link", "set", "eth0", "up")

    def exec(self, role: str) -> list[str]:
        return ["ip", "netns", "exec", self.names[role]]

    def close(self) -> None:
        for ns in reversed(self.made):
            sh("ip", "netns", "del", ns, check=False)


def _skip_reason() -> str | None:
    if shutil.which("ip") is None:
        return "needs iproute2's `ip` to create network namespaces"
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    return None


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    tmp = tmp_path_factory.mktemp("netns")
    ns, procs = Namespaces(), []
    try:
        try:
            ns.build()
        except subprocess.CalledProcessError as e:
            pytest.skip(f"cannot create network namespaces here: {e.stderr.strip()}")
        common = ["--model", "tiny", "--kv-cache-mb", "16", "--threads", "1", "--log-level", "INFO"]
        for role in ("prefill", "decode"):
            procs.append(_start(ns, role, tmp, common + ["--ready-file", str(tmp / f"{role}.json")]))
        _wait_files(procs, [tmp / "prefill.json", tmp / "decode.json"], tmp)
        procs.append(_start(ns, "router", tmp, [
            "--prefill", f"{SUBNET}.2:{PORT}", "--decode", f"{SUBNET}.3:{PORT}", "--log-level", "INFO",
            "--ready-file", str(tmp / "router.json")]))
        _wait_files(procs, [tmp / "router.json"], tmp)
        yield ns, tmp
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        ns.close()


def _start(ns: Namespaces, role: str, tmp: Path, argv: list[str]) -> subprocess.Popen:
    host = f"{SUBNET}.{HOSTS[role]}"
    # A namespace address is not loopback: plaintext needs --insecure (zpd.ops.exposure).
    cmd = ns.exec(role) + zpd_cmd(role, "--host", host, "--port", str(PORT), "--insecure", *argv)
    # `ip netns exec` execs the command: the Popen pid is the zpd process.
    return subprocess.Popen(cmd, cwd=ROOT, stdout=open(tmp / f"{role}.log", "wb"),
                            stderr=subprocess.STDOUT, env=os.environ | {"MC_FORCE_TCP": "1"})


def _wait_files(procs: list[subprocess.Popen], files: list[Path], tmp: Path) -> None:
    deadline = time.monotonic() + 120
    while not all(f.exists() for f in files):
        dead = [p for p in procs if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            logs = "\n".join(f"--- {f.name}\n{f.read_text()[-2000:]}" for f in tmp.glob("*.log"))
            raise RuntimeError(f"processes did not start in their namespaces:\n{logs}")
        time.sleep(0.2)


def in_client_ns(ns: Namespaces, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(ns.exec("client") + zpd_cmd(*argv), cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout + 60)


def _generate(ns: Namespaces, prompt: list[int]) -> dict:
    out = in_client_ns(ns, "generate", "--router", f"{SUBNET}.1:{PORT}", "--input-ids",
                       ",".join(map(str, prompt)), "--temperature", "0", "--max-new-tokens", "6",
                       "--json", "--timeout", "60")
    assert out.returncode == 0, out.stderr
    return orjson.loads(out.stdout)


def _admin(ns: Namespaces, *argv: str) -> dict:
    out = in_client_ns(ns, "admin", "--endpoint", f"{SUBNET}.1:{PORT}", "--timeout", "20", *argv)
    assert out.returncode == 0, (out.stdout, out.stderr)
    return orjson.loads(out.stdout)


def test_request_across_namespaces_is_exact(hosts):
    ns, _ = hosts
    prompt = [9, 8, 7, 6, 5, 4, 3, 2, 1] * 3
    ref = OfflineEngine(load_model("tiny")).run(
        [Request("r", prompt, SamplingParams(temperature=0, max_new_tokens=6))])[0]
    assert _generate(ns, prompt)["output_ids"] == ref["output_ids"]


def test_each_process_listens_only_on_its_own_address(hosts):
    ns, _ = hosts
    for role in ("router", "prefill", "decode"):
        listening = [line.split()[3] for line in sh(*ns.exec(role), "ss", "-ltnH").stdout.splitlines()]
        # Mooncake's own listeners (handshake RPC, TCP transport) bind every
        # interface of the namespace; zpd's ZeroMQ port binds only --host.
        assert [a for a in listening if a.endswith(f":{PORT}")] == [f"{SUBNET}.{HOSTS[role]}:{PORT}"]


def test_admin_pauses_and_continues_across_namespaces(hosts):
    ns, _ = hosts
    out = _admin(ns, "pause", "--mode", "in_place")
    assert out["ok"] and len(out["workers"]) == 2
    try:
        status = _admin(ns, "status")
        assert {w["endpoint"] for w in status["workers"]} == {f"{SUBNET}.2:{PORT}", f"{SUBNET}.3:{PORT}"}
        assert all(w["paused"] == "in_place" for w in status["workers"])
    finally:
        assert _admin(ns, "continue")["ok"]
    assert all(w["paused"] is None for w in _admin(ns, "status")["workers"])
    assert len(_generate(ns, [1, 2, 3])["output_ids"]) == 6
