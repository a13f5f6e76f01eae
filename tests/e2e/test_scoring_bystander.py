"""One caller's big scoring call does not hold another caller's short request (issue
43, item 5: a bystander's 4-token request waited 25.3 s behind 64 prompts x 2,000
tokens to score). A real cluster of the tiny model behind its HTTP front; the big
call from 127.0.0.1, the bystander's from 127.0.0.2 (another caller to the front,
which names callers by address), over real sockets."""
from __future__ import annotations

import http.client
import random
import threading
import time

import orjson

from tests.e2e.cluster import Cluster

PROMPTS, TOKENS, TOP = 48, 2000, 20
SMALL = {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}


def post(address: str, body: dict, source: str = "127.0.0.1") -> tuple[int, bytes]:
    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=300, source_address=(source, 0))
    try:
        conn.request("POST", "/generate", body=orjson.dumps(body),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def test_a_bystander_is_served_while_a_big_scoring_call_runs(tmp_path):
    # one prompt per prefill step, so that the call takes many steps (the default
    # 8192 tokens per step would make four)
    extra = ("--http-port", "0", "--max-call-logprobs", str(PROMPTS * TOKENS * (TOP + 1)),
             "--max-prefill-tokens", str(TOKENS), "--kv-cache-mb", "64")
    with Cluster(tmp_path, extra=extra) as cluster:
        http = cluster.info["http"]
        assert post(http, SMALL)[0] == 200                       # warm
        rng = random.Random(0)
        big = {"input_ids": [[rng.randrange(3, 250) for _ in range(TOKENS)] for _ in range(PROMPTS)],
               "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
               "logprob_start_len": 0, "top_logprobs_num": TOP}
        got: dict = {}

        def score() -> None:
            started = time.monotonic()
            got["big"] = post(http, big)
            got["seconds"] = time.monotonic() - started
        caller = threading.Thread(target=score)
        caller.start()
        time.sleep(0.5)                                          # its prompts are queued
        started = time.monotonic()
        status, body = post(http, SMALL, source="127.0.0.2")
        waited = time.monotonic() - started
        caller.join(300)
        assert status == 200 and len(orjson.loads(body)["output_ids"]) == 4, body[:300]
        status, body = got["big"]
        answers = orjson.loads(body)
        assert status == 200 and len(answers) == PROMPTS
        assert all(len(a["meta_info"]["input_token_logprobs"]) == TOKENS for a in answers)
        # before: first come, first served, the bystander waited for nearly all 48
        # steps (0.9 of the call); now it is in the step after the one under way
        assert waited < 0.35 * got["seconds"], (waited, got["seconds"])
