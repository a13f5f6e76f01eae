"""`zpd launch --model null`: the simulation's cluster over real processes, ZeroMQ and
Mooncake on loopback. Every token is predicted (engines/null.py), so a page the
transport garbled would show."""
from __future__ import annotations

import random
import time

import pytest

from engines.null import predict
from tests.e2e.cluster import Cluster, assert_all_pages_free

pytest.importorskip("mooncake.engine", reason="needs mooncake-transfer-engine(-non-cuda)")

STEP_MS = 5


def test_a_null_2p2d_cluster_answers_the_predicted_tokens(tmp_path):
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (1, 15, 16, 17, 100, 300) * 3]
    work = [{"input_ids": p, "sampling_params": {"temperature": 0, "max_new_tokens": 20}}
            for p in prompts]
    spec = f"null:step_ms={STEP_MS},prefill_us=20,kv_bytes=8192"
    with Cluster(tmp_path, prefill=2, decode=2, model=spec, dtype="bfloat16") as c, \
            c.client() as client:
        began = time.monotonic()
        got = client.generate_many(work)
        took = time.monotonic() - began
        assert [g["output_ids"] for g in got] == [predict(p, 20) for p in prompts]
        assert took >= 19 * STEP_MS / 1e3                  # the decode steps take their time
        text = client.generate(prompt="hello", sampling_params={"max_new_tokens": 6})
        assert text["output_ids"] == predict(list(b"hello"), 6)
        assert_all_pages_free(client)
