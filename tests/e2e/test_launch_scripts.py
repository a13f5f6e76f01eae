"""scripts/launch_*.sh: a hostfile of local entries brings up 1P1D and an HTTP front,
answers, logs per process, and `stop` leaves nothing behind. The decode line is written user@host,
which always goes over ssh; a stand-in ssh runs the command here, so the remote
path (command line, pid capture, remote stop) runs too."""
from __future__ import annotations

import os
import socket
import subprocess
import urllib.request
from pathlib import Path

import orjson
import pytest

from engines.loader import load_model
from engines.sampler import SamplingParams
from tests.e2e.cluster import ROOT, alive
from zpd.client import Client
from engines.offline import OfflineEngine
from engines.request import Request

pytest.importorskip("mooncake.engine", reason="needs mooncake-transfer-engine(-non-cuda)")

SCRIPTS = ROOT / "scripts"
FAKE_SSH = """#!/usr/bin/env bash
# Stand-in for ssh: skip options, record the target, run the command line here.
while [[ "$1" == -* ]]; do shift 2; done
echo "$1" >> "{targets}"
shift
exec bash -c "$*"
"""


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def cluster_script(hostfile: Path, env: dict, *action: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPTS / "launch_cluster.sh"), str(hostfile), *action],
                          env=env, capture_output=True, text=True, timeout=240)


def recorded_pids(run_dir: Path) -> list[int]:
    return [int(p.read_text().split()[2]) for p in (run_dir / "pids").glob("*.pid")]


def test_hostfile_cluster_starts_answers_and_stops(tmp_path: Path) -> None:
    prefill, decode, router, router2, http = free_ports(5)
    hostfile = tmp_path / "hosts"
    hostfile.write_text(f"# a 1P1D cluster on this host\n"
                        f"prefill 127.0.0.1 {prefill} --threads 1  # direct\n"
                        f"\n"
                        f"http 127.0.0.1 {http} --served-model-name scripted\n"
                        f"decode root@127.0.0.1 {decode} --threads 1\n"
                        f"router 127.0.0.1 {router}\n"
                        f"router 127.0.0.1 {router2}  # follows the first\n")
    fake_ssh = tmp_path / "ssh"
    fake_ssh.write_text(FAKE_SSH.format(targets=tmp_path / "ssh-targets"))
    fake_ssh.chmod(0o755)
    run_dir = tmp_path / "run"
    env = os.environ | {"ZPD_RUN_DIR": str(run_dir), "ZPD_SSH": str(fake_ssh),
                        "ZPD_KV_CACHE_MB": "16", "ZPD_STARTUP_TIMEOUT": "120",
                        "ZPD_LOG_LEVEL": "INFO"}
    pids: list[int] = []
    try:
        started = cluster_script(hostfile, env)
        pids = recorded_pids(run_dir)
        assert started.returncode == 0, started.stdout + started.stderr
        assert len(pids) == 5 and all(alive(p) for p in pids)
        assert f"http http://127.0.0.1:{http}" in started.stdout
        assert set((tmp_path / "ssh-targets").read_text().split()) == {"root@127.0.0.1"}

        again = cluster_script(hostfile, env)          # refuses to start twice
        assert again.returncode == 1 and "stop" in again.stderr

        prompt = [3, 1, 4, 1, 5, 9, 2, 6]
        with Client(f"127.0.0.1:{router}", timeout=60) as client:
            out = client.generate(input_ids=prompt, rid="script-rid",
                                  sampling_params={"temperature": 0, "max_new_tokens": 5})
        ref = OfflineEngine(load_model("tiny")).run(
            [Request("r", prompt, SamplingParams(temperature=0, max_new_tokens=5))])[0]
        assert out["output_ids"] == ref["output_ids"]
        with Client(f"127.0.0.1:{router}", timeout=60) as client:    # its follower proved
            followers = client.admin("status")["followers"]            # it is a router
            assert [f["endpoint"] for f in followers] == [f"127.0.0.1:{router2}"], followers
        assert (run_dir / "router.secret").stat().st_mode & 0o077 == 0
        with Client(f"127.0.0.1:{router2}", timeout=60) as client:   # the second router
            status = client.admin("status")
            assert status["coordinator"] == {"endpoint": f"127.0.0.1:{router}", "alive": True}
            assert client.generate(input_ids=prompt, sampling_params={
                "temperature": 0, "max_new_tokens": 5})["output_ids"] == ref["output_ids"]
        # the http line's front: a client of the file's router, with its extra options
        body = orjson.dumps({"input_ids": prompt, "sampling_params": {"temperature": 0,
                                                                      "max_new_tokens": 5}})
        with urllib.request.urlopen(urllib.request.Request(
                f"http://127.0.0.1:{http}/generate", body,
                {"Content-Type": "application/json"}), timeout=60) as r:
            assert orjson.loads(r.read())["output_ids"] == ref["output_ids"]
        with urllib.request.urlopen(f"http://127.0.0.1:{http}/v1/models", timeout=60) as r:
            assert [m["id"] for m in orjson.loads(r.read())["data"]] == ["scripted"]

        logs = {p.name.split("-")[0]: p.read_text() for p in (run_dir / "logs").glob("*.log")
                if p.name != f"router-127.0.0.1-{router2}.log"}     # the first router's
        assert set(logs) == {"prefill", "decode", "router", "http"}
        for role, text in logs.items():
            if role == "http":
                continue
            assert "rid='script-rid' room=" in text, (role, text[-2000:])
            if role != "router":
                assert "epoch=0" in text, (role, text[-2000:])

        stopped = cluster_script(hostfile, env, "stop")
        assert stopped.returncode == 0, stopped.stderr
        assert stopped.stdout.count("stopped ") == 5
        assert not any(alive(p) for p in pids), "stop left processes behind"
        assert not list((run_dir / "pids").glob("*.pid"))
        assert not list((run_dir / "ready").glob("*.json"))
    finally:
        for pid in pids:
            if alive(pid):
                os.kill(pid, 9)


def test_scripts_document_their_options(tmp_path: Path) -> None:
    for script, words in (("launch_prefill.sh", ["ZPD_HOST", "--ib-device", "ZPD_PROTOCOL",
                                                 "--log-file", "--curve-keys", "ZPD_MODEL"]),
                          ("launch_decode.sh", ["ZPD_DEVICE", "--dtype", "ZPD_IB_DEVICE"]),
                          ("launch_router.sh", ["--prefill", "ZPD_DECODE", "--log-file"]),
                          ("launch_http.sh", ["--router", "ZPD_API_KEY", "--served-model-name",
                                              "30000"]),
                          ("launch_cluster.sh", ["HOSTFILE", "stop", "ZPD_SSH", "user@host",
                                                 "http ", "ZPD_ADMIN_API_KEY"])):
        out = subprocess.run(["bash", str(SCRIPTS / script), "--help"], capture_output=True,
                             text=True, timeout=30)
        assert out.returncode == 0 and all(w in out.stdout for w in words), (script, out.stdout)
    bad = tmp_path / "bad"
    bad.write_text("prefill 127.0.0.1 1\nrouter 127.0.0.1 2\n")
    out = cluster_script(bad, os.environ | {"ZPD_RUN_DIR": str(tmp_path / "run")})
    assert out.returncode == 2 and "at least one prefill, one decode" in out.stderr
    bad.write_text("sidecar 127.0.0.1 1\n")
    out = cluster_script(bad, os.environ | {"ZPD_RUN_DIR": str(tmp_path / "run")})
    assert out.returncode == 2 and "unknown role" in out.stderr and "http" in out.stderr
