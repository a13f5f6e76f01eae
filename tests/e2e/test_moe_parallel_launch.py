"""Expert parallelism as users start it, on a Qwen3-MoE checkpoint (real processes, the
KV through Mooncake on loopback): `zpd launch --prefill-ep 2 --decode-tp 2` (the
prefill's attention whole on both its ranks, its experts 4 + 4; the decode's attention
split by heads and each expert's intermediate dimension by two), and `--prefill-tp 2
--prefill-ep 2 --decode-ep 2` (the decode's two ranks each receive every kv head). The
KV does not depend on the experts, so the pages move as between any TP sizes, and the
tokens are `zpd run`'s at one rank, with every page back."""
from __future__ import annotations

import pytest

from engines.loader import load_model
from engines.offline import OfflineEngine
from engines.request import Request
from engines.sampler import SamplingParams
from tests.e2e.cluster import Cluster, assert_all_pages_free
from tests.unit.hf_models import make_checkpoint

pytest.importorskip("mooncake.engine", reason="needs mooncake-transfer-engine(-non-cuda)")

PROMPTS = [[5, 17, 99, 3, 42, 7, 8, 200, 13, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [9, 8, 7, 6, 5]]
SAMPLING = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}


@pytest.mark.parametrize("sizes", [("--prefill-ep", "2", "--decode-tp", "2"),
                                   ("--prefill-tp", "2", "--prefill-ep", "2", "--decode-ep", "2")],
                         ids=["p-ep2-d-tp2", "p-tp2ep2-d-ep2"])
def test_prefill_and_decode_of_other_parallel_sizes(tmp_path, sizes):
    path = str(make_checkpoint("qwen3_moe", tmp_path))
    engine = OfflineEngine(load_model(path, dtype="float64"))
    ref = [out["output_ids"] for out in engine.run(
        [Request(f"ref{i}", p, SamplingParams(**SAMPLING)) for i, p in enumerate(PROMPTS)])]
    assert len(set(map(tuple, ref))) == 2 and all(len(set(r)) > 2 for r in ref)   # not degenerate
    with Cluster(tmp_path, model=path, extra=sizes) as c:
        with c.client() as client:
            got = client.generate_many([{"input_ids": p, "sampling_params": SAMPLING} for p in PROMPTS])
            assert [g["output_ids"] for g in got] == ref
            status = assert_all_pages_free(client)
            assert sorted(len(w["tp_pids"]) for w in status["workers"]) == [1, 1]
            sizes_of = {w["role"]: (w["tp_size"], w["ep_size"]) for w in status["workers"]}
            flags = dict(zip(sizes[::2], map(int, sizes[1::2])))
            assert sizes_of == {role: (flags.get(f"--{role}-tp", 1), flags.get(f"--{role}-ep", 1))
                                for role in ("prefill", "decode")}
