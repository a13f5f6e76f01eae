"""Mixture-of-experts workers split over ranks (`zpd prefill --ep 2`, `zpd decode --tp 2`,
real rank processes joined by gloo, the KV through the fake transport): the greedy
tokens of `zpd run` at one rank, every page back on every rank, and a checkpoint
loaded from disk reaching every rank's experts (each rank stages the whole model and
keeps its experts' rows) and a trainer's push of one expert's rows."""
from __future__ import annotations

import pytest
import torch

from engines.loader import load_model
from engines.offline import OfflineEngine
from engines.request import Request
from engines.sampler import SamplingParams
from tests.unit.hf_models import make_checkpoint
from tests.unit.inproc import InprocCluster, reference

pytest.importorskip("transformers", reason="transformers writes the test checkpoints")

PROMPTS = [torch.randint(1, 250, (n,), generator=torch.Generator().manual_seed(n)).tolist()
           for n in (5, 23)]


def _greedy(path: str, prompt: list[int], n: int) -> list[int]:
    engine = OfflineEngine(load_model(path, dtype="float64"), kv_cache_mb=1)
    return engine.run([Request("r", prompt, SamplingParams(temperature=0, max_new_tokens=n,
                                                           ignore_eos=True))])[0]["output_ids"]


def test_expert_parallel_workers_answer_and_update_from_disk(tmp_path):
    old = str(make_checkpoint("qwen3_moe", tmp_path, seed=0))
    new = str(make_checkpoint("qwen3_moe", tmp_path, seed=1))
    c = InprocCluster(model=old, tp=(1, 2), ep=(2, 2))      # prefill --ep 2, decode --tp 2 --ep 2
    try:
        rids = [c.submit(p, 10) for p in PROMPTS]
        wants = [reference(c, p, 10) for p in PROMPTS]
        assert max(len(set(w)) for w in wants) > 2           # not one token over and over
        for rid, want in zip(rids, wants):
            assert c.run(rid).token_ids == want, rid
        c.pump()
        c.check_pages()
        assert c.admin("pause", mode="retract")["ok"]
        got = c.admin("update_weights", path=new, weight_version="v1")
        assert got["ok"], got
        assert c.admin("continue")["ok"]
        answer = c.run(c.submit(PROMPTS[0], 10))
        want = _greedy(new, PROMPTS[0], 10)
        assert want != _greedy(old, PROMPTS[0], 10)            # the update shows
        assert answer.token_ids == want and set(answer.weight_versions) == {"v1"}
    finally:
        c.close()


@pytest.mark.parametrize("tp", [(2, 1), (1, 2)])
def test_tensor_parallel_moe_workers_answer_as_one_process(tmp_path, tp):
    """A mixture at --tp 2 on one side only (each expert's intermediate split in two,
    one all-reduce per layer): the prefill's KV, which the experts do not touch, serves
    a decode of the other size, and the tokens are one process's."""
    # GLM: shared experts, partial rotary; seed 5 answers more than one token over and over
    path = str(make_checkpoint("glm4_moe", tmp_path, seed=5))
    wants = [_greedy(path, p, 8) for p in PROMPTS]
    assert min(len(set(w)) for w in wants) > 2
    c = InprocCluster(model=path, tp=tp)
    try:
        rids = [c.submit(p, 8) for p in PROMPTS]
        for rid, want in zip(rids, wants):
            assert c.run(rid).token_ids == want, (tp, rid)
        c.pump()
        c.check_pages()
    finally:
        c.close()
