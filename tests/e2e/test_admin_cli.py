"""`zpd admin` end to end: every command through the CLI against a real 1P1D
cluster, through the router and straight to a worker; exit codes and JSON,
including the errors (unknown rid, missing checkpoint, unreachable endpoint)."""
from __future__ import annotations

import socket
import subprocess
import threading
import time

import orjson
import pytest

from engines.models.tiny import save_tiny
from tests.e2e.cluster import Cluster, ROOT, assert_all_pages_free, zpd_cmd

pytest.importorskip("mooncake.engine", reason="needs mooncake-transfer-engine(-non-cuda)")

LONG = {"temperature": 0, "max_new_tokens": 4000, "ignore_eos": True}


def admin(endpoint: str, *argv: str, timeout: float = 20.0) -> tuple[int, dict | None, str]:
    """Run `zpd admin`; (exit code, its one JSON object or None, stderr)."""
    out = subprocess.run(zpd_cmd("admin", "--endpoint", endpoint, "--timeout", str(timeout), *argv),
                         cwd=ROOT, capture_output=True, text=True, timeout=timeout + 60)
    lines = out.stdout.strip().splitlines()
    assert len(lines) <= 1, f"more than one line on stdout: {out.stdout!r}"
    return out.returncode, orjson.loads(lines[0]) if lines else None, out.stderr


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with Cluster(tmp_path_factory.mktemp("admin"), dtype="float32") as c:
        yield c


def worker(cluster: Cluster, role: str) -> str:
    return next(w["endpoint"] for w in cluster.info["workers"] if w["role"] == role)


def test_status_through_router_and_one_worker(cluster):
    rc, out, err = admin(cluster.router, "status")
    assert rc == 0 and out["ok"], err
    assert {w["role"] for w in out["workers"]} == {"prefill", "decode"}
    for w in out["workers"]:
        assert w["ok"] and w["paused"] is None and w["weight_version"] == "tiny"
        assert set(w["kv_pages"]) >= {"total", "free", "held", "fenced"}
        assert isinstance(w["queues"], dict) and "peers" in w
    rc, out, err = admin(worker(cluster, "decode"), "status")
    assert rc == 0 and out["ok"] and out["role"] == "decode", err
    assert out["endpoint"] == worker(cluster, "decode") and "workers" not in out


def test_unreachable_endpoint_fails_fast_with_a_clear_message():
    start = time.monotonic()
    rc, out, err = admin(f"127.0.0.1:{free_port()}", "status", timeout=2)
    assert rc == 3 and out["ok"] is False and out["status"] == 504
    assert "did not answer" in err and "status" in err
    assert time.monotonic() - start < 2 + 15      # the timeout plus the CLI's start-up


def test_bad_endpoint_and_bad_mode_are_usage_errors():
    rc, out, err = admin("no-port-here", "status")
    assert rc == 2 and out is None and "endpoint" in err
    rc, out, err = admin("127.0.0.1:1", "pause", "--mode", "sideways")
    assert rc == 2 and out is None and "sideways" in err


def test_abort_unknown_rid_is_404(cluster):
    rc, out, err = admin(cluster.router, "abort", "no-such-rid")
    assert rc == 1 and out["ok"] is False, out
    statuses = [out.get("status")] + [w.get("status") for w in out.get("workers", [])]
    assert 404 in statuses, out
    assert "no-such-rid" in err


def test_abort_running_request(cluster):
    """The CLI takes 2-6 s to start on a loaded machine: time enough for a request of any
    fixed length to end on its own. So once its decode has sent tokens the cluster is
    paused in place, where it stays running, unfinished, until the CLI's abort ends it."""
    result: dict = {"tokens": 0}
    first = threading.Event()
    client = cluster.client()       # the thread's alone until it ends (zmq: one thread a socket)

    def run() -> None:
        for chunk in client.stream(input_ids=[1, 2, 3], sampling_params=LONG, rid="to-abort"):
            result["last"], result["tokens"] = chunk, result["tokens"] + len(chunk["token_ids"])
            if result["tokens"] >= 2:   # the first may come from the prefill; this one, the decode
                first.set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    try:
        assert first.wait(60), "the request never started"
        _admin_call(cluster, "pause", mode="in_place")
        try:
            assert _running(cluster), f"ended before the pause: {result['last']}"
            rc, out, err = admin(cluster.router, "abort", "to-abort")
            assert rc == 0 and out["ok"], (out, err)
        finally:
            _admin_call(cluster, "continue")
        t.join(60)
        reason = result["last"]["finish_reason"]
        assert reason["type"] == "abort" and reason["status_code"] == 499
        assert 0 < result["tokens"] < LONG["max_new_tokens"]
    finally:
        if t.is_alive():            # a failure above: end the request through another client
            with cluster.client(timeout=10) as other:
                other.admin("abort", rid="to-abort", timeout=10)
            t.join(60)
        # closing a socket under the thread still reading it could hang the run: if the
        # thread is stuck, leave its client open
        assert not t.is_alive(), "generate did not return: its client must stay open"
        client.close()
    with cluster.client() as c:
        _wait_pages_free(c)


def _admin_call(cluster: Cluster, command: str, **args) -> dict:
    """One admin command through the Python client (the CLI is slow to start)."""
    with cluster.client(timeout=20) as c:
        out = c.admin(command, timeout=20, **args)
    assert out["ok"], out
    return out


def _running(cluster: Cluster) -> bool:
    with cluster.client(timeout=10) as c:
        out = c.admin("status")
    return any(w["role"] == "decode" and w["queues"].get("running", 0) > 0 for w in out["workers"])


def _wait_pages_free(client, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            assert_all_pages_free(client)
            return
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.3)


def test_update_weights_missing_checkpoint_fails_on_every_worker(cluster, tmp_path):
    missing = str(tmp_path / "no-such-checkpoint")
    rc, out, err = admin(cluster.router, "update-weights", "--path", missing, "--version", "v9")
    assert rc == 1 and out["ok"] is False
    assert len(out["workers"]) == 2
    for w in out["workers"]:
        assert not w["ok"] and w["status"] == 400 and "no-such-checkpoint" in w["error"], w
    assert all(w["weight_version"] == "tiny" for w in status(cluster))     # old weights kept


@pytest.mark.parametrize("mode", ["abort", "in_place", "retract"])
def test_pause_then_continue(cluster, mode):
    rc, out, err = admin(cluster.router, "pause", "--mode", mode)
    assert rc == 0 and out["ok"], (out, err)
    try:
        assert all(w["paused"] == mode for w in status(cluster))
    finally:
        rc, out, err = admin(cluster.router, "continue")
    assert rc == 0 and out["ok"], (out, err)
    assert all(w["paused"] is None for w in status(cluster))
    with cluster.client() as c:
        done = c.generate(input_ids=[4, 5], sampling_params={"max_new_tokens": 3})
        assert done["finish_reason"]["type"] == "length"


def test_flush_cache(cluster):
    rc, out, err = admin(cluster.router, "flush-cache")
    assert rc == 0 and out["ok"] and len(out["workers"]) == 2, (out, err)


def test_release_and_resume_memory(cluster):
    assert admin(cluster.router, "pause", "--mode", "retract")[0] == 0
    try:
        for command in ("release-memory", "resume-memory"):
            rc, out, err = admin(cluster.router, command)
            assert rc == 0 and out["ok"] and len(out["workers"]) == 2, (command, out, err)
    finally:
        assert admin(cluster.router, "continue")[0] == 0
    with cluster.client() as c:
        assert c.generate(input_ids=[4, 5], sampling_params={"max_new_tokens": 2})[
            "finish_reason"]["type"] == "length"
        assert_all_pages_free(c)


def test_update_weights_while_paused(cluster, tmp_path):
    """Last in this module: the cluster serves other weights afterwards."""
    checkpoint = save_tiny(tmp_path / "tiny7", seed=7)
    assert admin(cluster.router, "pause", "--mode", "retract")[0] == 0
    try:
        rc, out, err = admin(cluster.router, "update-weights", "--path", str(checkpoint),
                             "--version", "seven")
        assert rc == 0 and out["ok"], (out, err)
    finally:
        assert admin(cluster.router, "continue")[0] == 0
    assert [w["weight_version"] for w in status(cluster)] == ["seven", "seven"]
    with cluster.client() as c:
        done = c.generate(input_ids=[4, 5], sampling_params={"max_new_tokens": 2})
        assert done["weight_versions"] == ["seven", "seven"]


def status(cluster: Cluster) -> list[dict]:
    """Every worker's status, through the Python client (quicker than the CLI)."""
    with cluster.client(timeout=20) as c:
        out = c.admin("status")
    assert out["ok"], out
    return out["workers"]
