"""Routed experts (engines/routed.py) against transformers' routers: every prompt and
output position, every layer, for each mixture architecture, in float64."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engines.loader import load_model
from engines.offline import OfflineEngine
from engines.request import Request, Unservable
from engines.sampling_params import SamplingParams
from tests.unit.hf_models import (MOE_VARIANTS, by_expert, decoded, hf_model, make_checkpoint,
                                  reference_routing)

pytest.importorskip("transformers", reason="transformers is the test-time reference; pip install '.[test]'")

PROMPT_LENS = [1, 7, 19]          # one token, within a page, across pages
NEW_TOKENS = 6


@pytest.fixture(scope="module", params=sorted(MOE_VARIANTS))
def checkpoint(request, tmp_path_factory):
    return make_checkpoint(request.param, tmp_path_factory.mktemp("hf"))


def test_every_position_matches_transformers(checkpoint):
    model = load_model(str(checkpoint), dtype="float64")
    engine = OfflineEngine(model, kv_cache_mb=8, routed_experts=True)
    cfg, ref = model.cfg, hf_model(checkpoint, torch.float64)
    layers, k = cfg.num_layers, cfg.moe.top_k
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in PROMPT_LENS]
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0, ignore_eos=True,
                            return_routed_experts=True, return_routed_expert_weights=True)
    answers = engine.run([Request(f"r{i}", p, params) for i, p in enumerate(prompts)])
    dense = [i for i in range(layers) if not cfg.moe.sparse(i)]    # (Mixtral has none)
    for prompt, out in zip(prompts, answers):
        tokens = prompt + out["output_ids"]
        assert len(out["output_ids"]) == NEW_TOKENS
        ids = decoded(out["meta"], "routed_experts", np.int32, layers, k)
        weights = decoded(out["meta"], "routed_expert_weights", np.float32, layers, k)
        assert ids.shape == (len(tokens) - 1, layers, k)       # slime's (len(tokens) - 1, L, k)
        assert weights.shape == ids.shape
        want_ids, want_w = reference_routing(ref, tokens[:-1], layers, k)
        ours_ids, ours_w = by_expert(ids, weights.astype(np.float64))
        want_ids, want_w = by_expert(want_ids, want_w)
        for pos in range(len(tokens) - 1):
            assert (ours_ids[pos] == want_ids[pos]).all(), f"position {pos} (prompt {len(prompt)})"
        np.testing.assert_allclose(ours_w, want_w, rtol=0, atol=1e-6)   # float32 on the wire
        assert not ids[:, dense].any() and not weights[:, dense].any()


def test_ids_alone_and_nothing_unasked(checkpoint):
    model = load_model(str(checkpoint), dtype="float64")
    engine = OfflineEngine(model, kv_cache_mb=8, routed_experts=True)
    prompt = list(range(5))
    asked, plain = engine.run([
        Request("a", prompt, SamplingParams(max_new_tokens=3, temperature=0, ignore_eos=True,
                                            return_routed_experts=True)),
        Request("b", prompt, SamplingParams(max_new_tokens=3, temperature=0, ignore_eos=True))])
    assert "routed_expert_weights" not in asked["meta"]
    layers, k = model.cfg.num_layers, model.cfg.moe.top_k
    assert decoded(asked["meta"], "routed_experts", np.int32, layers, k).shape == (7, layers, k)
    assert "routed_experts" not in plain["meta"]
    assert asked["output_ids"] == plain["output_ids"]      # recording changes no token
    (scored,) = engine.run([Request("s", prompt, SamplingParams(max_new_tokens=0,
                                                                return_routed_experts=True))])
    ids = decoded(scored["meta"], "routed_experts", np.int32, layers, k)   # prompt - 1 rows
    assert (ids == decoded(asked["meta"], "routed_experts", np.int32, layers, k)[:4]).all()


def test_refused_by_name(tmp_path):
    ask = SamplingParams(max_new_tokens=2, return_routed_experts=True)
    dense = OfflineEngine(load_model("tiny"), kv_cache_mb=4, routed_experts=True)
    with pytest.raises(Unservable, match="dense"):
        dense.submit(Request("d", [1, 2], ask))
    moe = load_model(str(make_checkpoint("qwen3_moe", tmp_path)))
    with pytest.raises(Unservable, match="--enable-return-routed-experts"):
        OfflineEngine(moe, kv_cache_mb=4).submit(Request("m", [1, 2], ask))
    with pytest.raises(ValueError, match="return_routed_experts"):
        SamplingParams(return_routed_experts=1)


def test_rollout_lengths_pass_and_the_limit_is_refused_by_name():
    """32k positions of Qwen3-30B-A3B (48 x 8 ids each) and 16k of GLM-4.5 (92 x 8) are
    served with their weights (engines/routed_wire.py budgets ids and weights apart);
    past a budget the refusal names the field and the most positions it allows."""
    from engines.config import ModelConfig
    from engines.routed import routed_refusal
    from tests.unit.test_moe_config import GLM45_AIR, QWEN3_30B_A3B
    qwen = ModelConfig.from_dict(QWEN3_30B_A3B)
    glm = ModelConfig.from_dict(GLM45_AIR | dict(num_hidden_layers=92, n_routed_experts=160,
                                                 first_k_dense_replace=3))
    for cfg, positions in ((qwen, 32768), (glm, 16384)):
        for want in ("ids", "weights"):
            assert routed_refusal(cfg, True, want, positions + 1) is None, (cfg.architecture, want)
    ids = routed_refusal(glm, True, "ids", 50_000)
    assert ids.startswith("return_routed_experts:") and "at most 45590 positions" in ids, ids
    weights = routed_refusal(glm, True, "weights", 32768)
    assert weights.startswith("return_routed_expert_weights:") and "22795" in weights, weights
    assert routed_refusal(glm, True, "ids", 32768) is None      # the ids alone still fit


def test_more_than_256_experts_travel_as_int16():
    """A kv_done's pieces back to the rows (engines/routed.py), int16 where uint8 cannot
    hold the ids; ids past the model's experts are refused by name."""
    from engines.config import ModelConfig
    from engines.routed import RoutedExperts, from_pieces, piece_fields
    from tests.unit.test_moe_config import QWEN3_30B_A3B
    cfg = ModelConfig.from_dict(QWEN3_30B_A3B | dict(num_experts=300))
    ids = torch.randint(0, 300, (5, 48, 8), dtype=torch.int16)
    rows = RoutedExperts(ids, torch.rand(5, 48, 8))
    sent = piece_fields(rows)
    assert rows.wire(5)[0] == "int16" and sum(map(len, sent["routed_experts"])) == 2 * ids.numel()
    got = from_pieces(cfg, 5, sent["routed_experts"], sent["routed_expert_weights"], True)
    assert torch.equal(got.ids(), ids) and torch.equal(got.weights(), rows.weights())
    ids[2, 3, 1] = 300
    bad = piece_fields(RoutedExperts(ids))["routed_experts"]
    assert "outside [0, 300)" in from_pieces(cfg, 5, bad, None, False)
