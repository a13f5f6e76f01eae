"""Tensor-parallel workers as users start them: `zpd launch --prefill-tp 2 --decode-tp 1`
(real processes, the KV through Mooncake on loopback) answers `zpd run`'s greedy tokens,
and a killed non-zero rank stops its worker: the router sees it gone and the next
request ends with 503, not a hang."""
from __future__ import annotations

import os
import signal
import time

import pytest

from engines.loader import load_model
from engines.offline import OfflineEngine
from engines.request import Request
from engines.sampler import SamplingParams
from tests.e2e.cluster import Cluster, assert_all_pages_free

pytest.importorskip("mooncake.engine", reason="needs mooncake-transfer-engine(-non-cuda)")

PROMPT = [5, 17, 99, 3, 42, 7, 8, 200, 13, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]


def test_prefill_of_two_ranks_decode_of_one(tmp_path):
    model = load_model("tiny", dtype="float64")
    ref = OfflineEngine(model).run([Request("ref", PROMPT, SamplingParams(
        temperature=0, max_new_tokens=16, ignore_eos=True))])[0]["output_ids"]
    with Cluster(tmp_path, extra=("--prefill-tp", "2", "--decode-tp", "1")) as c:
        with c.client() as client:
            got = client.generate(input_ids=PROMPT, sampling_params={
                "temperature": 0, "max_new_tokens": 16, "ignore_eos": True})
            assert got["output_ids"] == ref
            assert_all_pages_free(client)
            (prefill,) = [w for w in client.admin("status")["workers"] if w["role"] == "prefill"]
            assert prefill["tp_size"] == 2 and len(prefill["tp_pids"]) == 1
            os.kill(prefill["tp_pids"][0], signal.SIGKILL)
            deadline = time.monotonic() + 60
            while any(w.get("role") == "prefill" and w.get("ok")
                      for w in client.admin("status")["workers"]):
                assert time.monotonic() < deadline, "the prefill did not stop"
                time.sleep(0.5)
            late = client.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 4})
            assert late["finish_reason"]["status_code"] == 503, late["finish_reason"]
