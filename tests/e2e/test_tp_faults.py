"""A tensor-parallel decode (`zpd launch --decode-tp 2`, real processes, the KV through
Mooncake on loopback) whose rank 1 fails (issue 43):

- its memory resume fails for real (prlimit: rank 1 cannot map its new pool): the
  worker answers 500 and stays released, `continue` is 409, and a retried resume
  works end to end (Mooncake registration and the prefill's handshake with the new
  pool: before, requests then failed with "refused Mooncake's handshake");
- it is stopped (SIGSTOP): a request ends with 503 within seconds, not after the
  120 s collective timeout, and the router sees the decode gone;
- no /dev/shm/zpd-kv-* file of the rank outlives the cluster."""
from __future__ import annotations

import glob
import os
import resource
import signal
import time

import pytest

from engines.tp.heartbeat import SILENT_S
from tests.e2e.cluster import Cluster, assert_all_pages_free

pytest.importorskip("mooncake.engine", reason="needs mooncake-transfer-engine(-non-cuda)")

PROMPT = [5, 17, 99, 3, 42, 7, 8, 200, 13, 1]
GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}


def _decode(reply: dict) -> dict:
    return next(w for w in reply["workers"] if w.get("role") == "decode")


def _vm_size(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))


def _failed_resume_then_retry(client, rank1: int, want: list[int]) -> None:
    assert client.admin("pause", mode="retract")["ok"]
    assert client.admin("release_memory", tags=["kv_cache"])["ok"]
    limits = resource.prlimit(rank1, resource.RLIMIT_AS)
    resource.prlimit(rank1, resource.RLIMIT_AS, (_vm_size(rank1) + (4 << 20), limits[1]))
    try:
        failed = client.admin("resume_memory", tags=["kv_cache"])
    finally:
        resource.prlimit(rank1, resource.RLIMIT_AS, limits)
    assert _decode(failed)["status"] == 500 and "stays released" in _decode(failed)["error"], failed
    assert _decode(client.admin("continue"))["status"] == 409
    assert _decode(client.admin("status"))["memory"] == "released"
    assert client.admin("resume_memory", tags=["kv_cache"])["ok"]
    assert client.admin("continue")["ok"]
    got = client.generate(input_ids=PROMPT, sampling_params=GREEDY)
    assert got["output_ids"] == want, got["finish_reason"]


def _stopped_rank_ends_requests(cluster, rank1: int) -> None:
    """Rank 1 stopped, then a request: its first decode step waits for rank 1."""
    os.kill(rank1, signal.SIGSTOP)
    try:
        with cluster.client() as c:
            began = time.monotonic()
            got = c.generate(input_ids=PROMPT, sampling_params=GREEDY)
            took = time.monotonic() - began
            assert got["finish_reason"].get("status_code") == 503, got["finish_reason"]
            assert took < SILENT_S + 6, f"the request ended {took:.1f} s after it was sent"
            status = _decode(c.admin("status", timeout=5))
            assert not status.get("ok"), f"the decode still looks healthy: {status}"
            began = time.monotonic()
            late = c.generate(input_ids=PROMPT, sampling_params=GREEDY)
            assert late["finish_reason"].get("status_code") == 503, late["finish_reason"]
            assert time.monotonic() - began < 5, "a later request waited for the lost decode"
    finally:
        try:
            os.kill(rank1, signal.SIGCONT)
        except ProcessLookupError:
            pass                                       # killed by its leader, as it should be


def test_a_failing_and_a_frozen_decode_rank(tmp_path):
    with Cluster(tmp_path, extra=("--decode-tp", "2")) as cluster:
        with cluster.client() as client:
            want = client.generate(input_ids=PROMPT, sampling_params=GREEDY)["output_ids"]
            (rank1,) = _decode(client.admin("status"))["tp_pids"]
            _failed_resume_then_retry(client, rank1, want)
            assert_all_pages_free(client)
        _stopped_rank_ends_requests(cluster, rank1)
    assert glob.glob(f"/dev/shm/zpd-kv-{rank1}-*") == []
