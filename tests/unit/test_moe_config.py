"""Mixture-of-experts configs as the published checkpoints write them, and the routers
against brute-force restatements of their rules."""
from __future__ import annotations

import itertools

import pytest
import torch

from engines.config import ModelConfig, ModelError, MoeConfig
from engines.models.routing import route, route_grouped_sigmoid, route_softmax

# the fields that matter of Qwen3-30B-A3B's, Mixtral-8x7B's and GLM-4.5-Air's config.json
QWEN3_30B_A3B = dict(
    architectures=["Qwen3MoeForCausalLM"], hidden_size=2048, intermediate_size=6144,
    moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
    decoder_sparse_step=1, mlp_only_layers=[], num_hidden_layers=48, num_attention_heads=32,
    num_key_value_heads=4, head_dim=128, rope_theta=1000000.0, max_position_embeddings=40960,
    vocab_size=151936, rms_norm_eps=1e-6, sliding_window=None, use_sliding_window=False)
MIXTRAL_8X7B = dict(
    architectures=["MixtralForCausalLM"], hidden_size=4096, intermediate_size=14336,
    num_local_experts=8, num_experts_per_tok=2, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, rope_theta=1000000.0, max_position_embeddings=32768,
    vocab_size=32000, rms_norm_eps=1e-5, sliding_window=None)
GLM45_AIR = dict(
    architectures=["Glm4MoeForCausalLM"], hidden_size=4096, intermediate_size=10944,
    moe_intermediate_size=1408, n_routed_experts=128, n_shared_experts=1,
    num_experts_per_tok=8, n_group=1, topk_group=1, first_k_dense_replace=1,
    routed_scaling_factor=1.0, norm_topk_prob=True, num_hidden_layers=46,
    num_attention_heads=96, num_key_value_heads=8, head_dim=128, partial_rotary_factor=0.5,
    attention_bias=True, use_qk_norm=False, rope_theta=1000000.0,
    max_position_embeddings=131072, vocab_size=151552, num_nextn_predict_layers=1)


def test_qwen3_moe_config():
    cfg = ModelConfig.from_dict(QWEN3_30B_A3B)
    assert cfg.moe == MoeConfig(router="softmax", num_experts=128, top_k=8, intermediate_size=768,
                                dense_layers=(), norm_topk_prob=True)
    assert cfg.qk_norm and cfg.rotary == 128 and cfg.rotary_dim is None
    sparse_every_other = ModelConfig.from_dict(QWEN3_30B_A3B | dict(decoder_sparse_step=2,
                                                                    mlp_only_layers=[5]))
    assert sparse_every_other.moe.dense_layers == tuple(sorted({*range(0, 48, 2), 5}))


def test_mixtral_config():
    cfg = ModelConfig.from_dict(MIXTRAL_8X7B)
    assert cfg.moe == MoeConfig(router="softmax", num_experts=8, top_k=2, intermediate_size=14336)
    assert cfg.head_dim == 128 and not cfg.qk_norm and not cfg.attention_bias


def test_glm45_config():
    cfg = ModelConfig.from_dict(GLM45_AIR)
    assert cfg.moe == MoeConfig(router="grouped_sigmoid", num_experts=128, top_k=8,
                                intermediate_size=1408, dense_layers=(0,), shared_experts=1)
    assert cfg.rotary_dim == 64 and cfg.rotary == 64 and cfg.attention_bias and not cfg.qk_norm
    # transformers 5 writes the factor inside rope_parameters
    moved = {k: v for k, v in GLM45_AIR.items() if k != "partial_rotary_factor"} | {
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5}}
    assert ModelConfig.from_dict(moved).rotary_dim == 64


def test_experts_do_not_change_what_kv_must_agree_on():
    """Two workers exchange KV when their attention agrees: the experts are not part
    of it, the weight update's shape check is stricter."""
    a = ModelConfig.from_dict(QWEN3_30B_A3B)
    b = ModelConfig.from_dict(QWEN3_30B_A3B | dict(num_experts=64))
    assert a.fingerprint() == b.fingerprint() and a.shape() != b.shape()


@pytest.mark.parametrize("change,words", [
    (dict(num_experts_per_tok=0), "cannot route each token to 0"),
    (dict(num_experts_per_tok=200), "cannot route each token to 200"),
])
def test_impossible_routing_is_refused_by_name(change, words):
    with pytest.raises(ModelError, match=words):
        ModelConfig.from_dict(QWEN3_30B_A3B | change)


@pytest.mark.parametrize("change,words", [
    (dict(n_group=3), "do not split 128 experts"),
    (dict(n_group=8, topk_group=9), "do not split"),
    (dict(n_group=8, topk_group=1, num_experts_per_tok=20), "cannot be chosen"),
    (dict(partial_rotary_factor=0.01), "partial_rotary_factor"),
])
def test_impossible_glm_groups_are_refused_by_name(change, words):
    with pytest.raises(ModelError, match=words):
        ModelConfig.from_dict(GLM45_AIR | change)


def test_deepseek_and_qwen2_moe_are_refused_by_name():
    for arch in ("DeepseekV3ForCausalLM", "Qwen2MoeForCausalLM"):
        with pytest.raises(ModelError, match=arch):
            ModelConfig.from_dict(GLM45_AIR | dict(architectures=[arch]))


def test_softmax_router_is_the_top_k_of_the_softmax():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(50, 8, generator=g, dtype=torch.float64)
    for norm in (False, True):
        ids, w = route_softmax(logits, 3, norm)
        probs = torch.softmax(logits.float(), -1)
        for t in range(50):
            want = sorted(range(8), key=lambda e: -probs[t, e].item())[:3]
            assert ids[t].tolist() == want
            expect = probs[t, want] / (probs[t, want].sum() if norm else 1)
            assert torch.allclose(w[t], expect)
        assert w.dtype == torch.float32


def _grouped_by_rule(scores: torch.Tensor, bias: torch.Tensor, m: MoeConfig) -> list[set[int]]:
    """GLM's choice restated: the best topk_group groups by the sum of their two best
    biased scores, then the best k experts of those groups by biased score."""
    size = m.num_experts // m.n_group
    out = []
    for row in scores + bias:
        rank = lambda g: sum(sorted(row[g * size:(g + 1) * size].tolist())[-2:])
        groups = sorted(range(m.n_group), key=rank)[-m.topk_group:]
        allowed = [e for g in groups for e in range(g * size, (g + 1) * size)]
        out.append(set(sorted(allowed, key=lambda e: row[e].item())[-m.top_k:]))
    return out


@pytest.mark.parametrize("n_group,topk_group", [(1, 1), (4, 2), (8, 3)])
def test_grouped_sigmoid_router_follows_its_rule(n_group, topk_group):
    m = MoeConfig(router="grouped_sigmoid", num_experts=16, top_k=4, intermediate_size=8,
                  n_group=n_group, topk_group=topk_group, routed_scaling_factor=2.5)
    g = torch.Generator().manual_seed(n_group)
    logits = torch.randn(40, 16, generator=g)
    bias = torch.randn(16, generator=g) * 0.3
    ids, w = route_grouped_sigmoid(logits, bias, m)
    scores = logits.sigmoid()
    assert [set(r) for r in ids.tolist()] == _grouped_by_rule(scores, bias, m)
    chosen = scores.gather(1, ids)            # the unbiased scores, renormalised, scaled
    assert torch.allclose(w, chosen / chosen.sum(-1, keepdim=True) * 2.5)
    assert torch.equal(route(logits, bias, m)[0], ids)


def test_the_bias_moves_the_choice_not_the_weights():
    m = MoeConfig(router="grouped_sigmoid", num_experts=4, top_k=1, intermediate_size=8,
                  norm_topk_prob=False)
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    ids, w = route_grouped_sigmoid(logits, torch.tensor([0.0, 0.0, 0.0, 5.0]), m)
    assert ids.tolist() == [[3]] and torch.allclose(w, logits[:, 3:].sigmoid())
    assert list(itertools.chain(*route_grouped_sigmoid(logits, torch.zeros(4), m)[0].tolist())) == [0]
