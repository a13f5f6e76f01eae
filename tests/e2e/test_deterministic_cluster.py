"""--deterministic through a real 2P2D cluster (zpd launch, Mooncake on loopback): every
request's tokens and logprobs are the bits of `zpd run`, whichever prefill and decode
served it, in a batch of others, after a pause(retract) -> continue with the same
weights; and a scoring pass (max_new_tokens 0) of prompt + output gives the output's
logprobs as the prompt's."""
from __future__ import annotations

import random

import pytest

from engines.loader import load_model
from engines.offline import OfflineEngine
from engines.request import Request
from engines.sampler import SamplingParams
from tests.e2e.cluster import Cluster, assert_all_pages_free
from zpd.client import assemble

pytest.importorskip("mooncake.engine", reason="needs mooncake-transfer-engine(-non-cuda)")

RNG = random.Random(480)
WORK = [[RNG.randrange(1, 250) for _ in range(RNG.choice([1, 5, 17, 40, 90]))] for _ in range(10)]


def params(i: int, new: int) -> dict:
    """Greedy for even i, sampled with a seed for odd i; logprobs always."""
    p = {"max_new_tokens": new, "ignore_eos": True, "return_logprob": True}
    return p | ({"temperature": 0} if i % 2 == 0 else {"temperature": 1.0, "top_p": 0.9, "seed": 7 + i})


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with Cluster(tmp_path_factory.mktemp("det"), prefill=2, decode=2, dtype="float32",
                 extra=("--deterministic", "--max-batch", "64")) as c:
        yield c


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny", dtype="float32")


def zpd_run(model, new: int) -> list[dict]:
    """`zpd run`'s answers to WORK, in one batch (the same bits as each alone: the unit
    tests show it, tests/unit/test_deterministic.py)."""
    reqs = [Request(f"ref{i}", list(p), SamplingParams.from_dict(params(i, new))) for i, p in enumerate(WORK)]
    return OfflineEngine(model, kv_cache_mb=16, deterministic=True).run(reqs)


def test_the_cluster_gives_zpd_runs_bits_and_scoring_equals_the_rollout(cluster, tiny):
    with cluster.client() as client:
        status = client.admin("status")
        assert [w["deterministic"] for w in status["workers"]] == [True] * 4, status
        outs = client.generate_many([{"input_ids": p, "sampling_params": params(i, 12)}
                                     for i, p in enumerate(WORK)])
        served = [w["counters"]["prefix_cache_query_tokens"] for w in client.admin("status")["workers"]]
        assert all(served), f"a worker served nothing: {served}"      # any prefill, any decode
        for i, (out, ref) in enumerate(zip(outs, zpd_run(tiny, 12))):
            assert out["output_ids"] == ref["output_ids"], i
            assert out["output_token_logprobs"] == ref["output_token_logprobs"], i
        scored = client.generate_many([
            {"input_ids": p + o["output_ids"], "sampling_params": {
                "max_new_tokens": 0, "return_logprob": True, "logprob_start_len": len(p)}}
            for p, o in zip(WORK, outs)])
        for i, (out, score) in enumerate(zip(outs, scored)):
            assert [v for v, _ in score["input_token_logprobs"]] == out["output_token_logprobs"], i
        assert_all_pages_free(client)


def test_retract_continue_with_the_same_weights_equals_never_pausing(cluster, tiny):
    new = 120
    with cluster.client() as client, cluster.client() as admin:
        rids = [client.submit(input_ids=p, sampling_params=params(i, new), stream=True, rid=f"d{i}")
                for i, p in enumerate(WORK)]
        chunks: dict[str, list[dict]] = {r: [] for r in rids}
        paused = False
        while not all(c and c[-1]["finished"] for c in chunks.values()):
            chunk = client.receive(timeout=60)
            chunks[chunk["rid"]].append(chunk)
            midway = sum(1 for c in chunks.values() if c and not c[-1]["finished"])
            if not paused and midway >= 3:
                assert admin.admin("pause", mode="retract", timeout=30)["ok"]
                assert admin.admin("continue")["ok"]
                paused = True
        outs = [assemble(chunks[r]) for r in rids]
        assert any(o["meta"]["retractions"] for o in outs), "nothing was retracted"
        for i, (out, ref) in enumerate(zip(outs, zpd_run(tiny, new))):
            assert out["output_ids"] == ref["output_ids"], (i, out["meta"])
            assert out["output_token_logprobs"] == ref["output_token_logprobs"], (i, out["meta"])
        assert_all_pages_free(client)
