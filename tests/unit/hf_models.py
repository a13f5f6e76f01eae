"""Small random Hugging Face checkpoints for reference tests (transformers is test-only)."""
from __future__ import annotations

import base64
from pathlib import Path

import numpy as np
import torch

VARIANTS = {
    "llama": dict(cls="LlamaConfig", extra={}),
    "llama3_tied": dict(cls="LlamaConfig", extra=dict(
        tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32})),
    "qwen2": dict(cls="Qwen2Config", extra={}),
    "qwen3": dict(cls="Qwen3Config", extra=dict(head_dim=16)),
    "mistral": dict(cls="MistralConfig", extra=dict(sliding_window=None)),
}
# mixtures of experts: three layers, one of them dense where the architecture has them
MOE_VARIANTS = {
    "qwen3_moe": dict(cls="Qwen3MoeConfig", extra=dict(
        head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        norm_topk_prob=True, mlp_only_layers=[1], num_hidden_layers=3)),
    "mixtral": dict(cls="MixtralConfig", extra=dict(
        num_local_experts=4, num_experts_per_tok=2, sliding_window=None, num_hidden_layers=3)),
    "glm4_moe": dict(cls="Glm4MoeConfig", extra=dict(
        head_dim=16, n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
        n_group=4, topk_group=2, first_k_dense_replace=1, n_shared_experts=1,
        routed_scaling_factor=2.5, use_qk_norm=True, attention_bias=True, num_hidden_layers=3)),
}
VARIANTS.update(MOE_VARIANTS)


def make_checkpoint(kind: str, root: Path, seed: int = 0, shard: bool = False, **sizes) -> Path:
    """`sizes` overrides the config's sizes (default: hidden 64 in 4 heads of 16)."""
    import transformers
    spec = VARIANTS[kind]
    shape = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512) | sizes
    cfg = getattr(transformers, spec["cls"])(rms_norm_eps=1e-6, **(shape | spec["extra"] | sizes))
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(torch.float32)
    with torch.no_grad():
        for p in model.parameters():    # larger than the default init: peaked logits, no near-ties
            p.normal_(0.0, 0.2)
        for name, b in model.named_buffers():   # GLM's load-balancing bias: not zero, so it counts
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.2)
    path = root / "-".join([kind, str(seed), *map(str, sizes.values())])
    model.save_pretrained(path, max_shard_size="100KB" if shard else "2GB")
    return path


def hf_model(path: Path, dtype: torch.dtype):
    import transformers
    # eager experts: transformers' grouped_mm takes no float64
    m = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, experts_implementation="eager")
    return m.eval()


@torch.inference_mode()
def reference_routing(ref, tokens: list[int], layers: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """transformers' router choice at every position of `tokens`, from hooks on each
    mixture layer's gate (it returns logits, weights, indices): ids and weights
    [T, layers, k], zeros in dense layers."""
    ids = np.zeros((len(tokens), layers, k), dtype=np.int32)
    weights = np.zeros((len(tokens), layers, k), dtype=np.float64)
    hooks = []
    for i, layer in enumerate(ref.model.layers):
        gate = getattr(layer.mlp, "gate", None)
        if gate is None or not hasattr(gate, "top_k"):       # a dense layer's MLP
            continue

        def keep(_module, _args, out, i=i):
            _, w, idx = out
            ids[:, i], weights[:, i] = idx.numpy(), w.double().numpy()
        hooks.append(gate.register_forward_hook(keep))
    try:
        ref(torch.tensor([tokens]))
    finally:
        for h in hooks:
            h.remove()
    return ids, weights


def by_expert(ids: np.ndarray, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each row's experts in ascending id order, their weights in the same order (the
    routers order them by score, or not at all)."""
    order = np.argsort(ids, axis=-1, kind="stable")
    return np.take_along_axis(ids, order, -1), np.take_along_axis(weights, order, -1)


def decoded(meta: dict, key: str, dtype, layers: int, k: int) -> np.ndarray:
    """SGLang's decoding of meta_info.routed_experts (slime's reshape)."""
    return np.frombuffer(base64.b64decode(meta[key]), dtype=dtype).reshape(-1, layers, k)
