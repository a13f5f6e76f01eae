"""Mixtures of experts in GGUF files: the router, experts and shared experts under
llama.cpp's names and keys, as its convert_hf_to_gguf.py writes them.

llama.cpp stacks each layer's experts into one tensor per projection,
blk.N.ffn_{gate,up,down}_exps.weight of [E, rows, cols] (ggml's order reversed). We
hand each expert out as the checkpoint tensor it came from
(model.layers.N.mlp.experts.E.gate_proj.weight ...), read from its own bytes of the
stacked tensor, so it lands in our stacked parameters by the same row ranges a Hugging
Face checkpoint's per-expert tensors do (engines/formats/weights.py) and a quantized
file is dequantized one expert at a time. The metadata keys become the Hugging Face
config fields engines/config.py reads:

  {arch}.expert_count                -> num_experts (Mixtral: num_local_experts, GLM: n_routed_experts)
  {arch}.expert_used_count           -> num_experts_per_tok
  {arch}.expert_feed_forward_length  -> moe_intermediate_size (Mixtral: feed_forward_length)
  {arch}.expert_shared_count         -> n_shared_experts (GLM)
  {arch}.expert_weights_scale        -> routed_scaling_factor (GLM)
  {arch}.expert_weights_norm         -> norm_topk_prob (absent: llama.cpp's default, true)
  {arch}.expert_group_count / expert_group_used_count -> n_group / topk_group (GLM)
  {arch}.expert_gating_func          -> checked against the router (1 softmax, 2 sigmoid)
  {arch}.leading_dense_block_count   -> first_k_dense_replace (GLM; checked against the tensors)
  {arch}.nextn_predict_layers        -> GLM's multi-token-prediction blocks, past the
                                        model's layers: skipped (no speculative decoding)
  {arch}.rope.dimension_count        -> GLM's partial rotary

Which layers are dense (Qwen3-MoE's mlp_only_layers, GLM's first layers) is read from
the tensors: a block with a router (ffn_gate_inp) is a mixture.
"""
from __future__ import annotations

import re
from typing import Any, Callable

from engines.config import ModelError

# GGUF architecture -> its mixture's Hugging Face architecture ("llama" with experts is Mixtral)
MOE_ARCHITECTURES = {"qwen3moe": "Qwen3MoeForCausalLM", "llama": "MixtralForCausalLM",
                     "glm4moe": "Glm4MoeForCausalLM"}
# llama.cpp's expert_gating_func values (gguf.ExpertGatingFuncType)
GATING = {1: "softmax", 2: "sigmoid"}
ROUTER_GATING = {"Qwen3MoeForCausalLM": "softmax", "MixtralForCausalLM": "softmax",
                 "Glm4MoeForCausalLM": "sigmoid"}

# per block: llama.cpp's name -> ours (the router, GLM's bias, shared experts)
MOE_BLOCK_NAMES: dict[str, str] = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}
# a whole name of llama.cpp's whose suffix is not ours
MOE_FULL_NAMES: dict[str, str] = {"exp_probs_b.bias": "mlp.gate.e_score_correction_bias"}
# the stacked experts: llama.cpp's name -> each expert's projection
STACKED: dict[str, str] = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj",
                           "ffn_down_exps": "down_proj"}
STACKED_NAME = re.compile(r"blk\.(\d+)\.(ffn_(?:gate|up|down)_exps)\.weight")
# llama.cpp's layout before experts were stacked (blk.N.ffn_gate.E.weight)
PER_EXPERT = re.compile(r"blk\.\d+\.ffn_(?:gate|up|down)\.\d+\.weight")


def moe_architecture(arch: str, key: Callable[[str], Any]) -> str | None:
    """The Hugging Face architecture of GGUF architecture `arch` if its file is a
    mixture (`key` reads `{arch}.*` metadata), else None."""
    if arch not in MOE_ARCHITECTURES:
        return None
    if arch == "llama" and not key("expert_count"):
        return None                     # a dense Llama or Mistral
    return MOE_ARCHITECTURES[arch]


def moe_fields(path: str, hf_arch: str, key: Callable[[str], Any], names: set[str],
               layers: int, head_dim: int) -> dict:
    """The Hugging Face config fields of a mixture's metadata `key` and tensor `names`;
    ModelError naming the file for a variant the engine does not run."""
    def refuse(why: str) -> ModelError:
        return ModelError(f"{path}: unsupported GGUF mixture of experts ({hf_arch}): {why}")

    experts, used = key("expert_count"), key("expert_used_count")
    if not experts or not used:
        raise refuse("metadata lacks expert_count or expert_used_count")
    gating = key("expert_gating_func")
    if gating is not None and GATING.get(gating) != ROUTER_GATING[hf_arch]:
        raise refuse(f"expert_gating_func {gating} ({GATING.get(gating, 'unknown')}); "
                     f"this architecture's router is {ROUTER_GATING[hf_arch]}")
    mixture = [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" in names]
    dense = [i for i in range(layers) if i not in mixture]
    raw: dict[str, Any] = {
        "num_experts_per_tok": used,
        "norm_topk_prob": bool(key("expert_weights_norm", True)),
    }
    if hf_arch == "Glm4MoeForCausalLM":
        lead = key("leading_dense_block_count")
        if dense != list(range(len(dense))) or lead is not None and lead != len(dense):
            raise refuse(f"dense layers {dense} are not the first leading_dense_block_count "
                         f"({lead}) layers")
        rotary = key("rope.dimension_count", head_dim)
        if not 2 <= rotary <= head_dim or rotary % 2:
            raise refuse(f"rope.dimension_count {rotary} of a head of {head_dim}")
        raw |= {"n_routed_experts": experts, "first_k_dense_replace": len(dense),
                "n_group": key("expert_group_count", 1), "topk_group": key("expert_group_used_count", 1),
                "routed_scaling_factor": float(key("expert_weights_scale", 1.0)),
                "n_shared_experts": key("expert_shared_count", 0),
                "partial_rotary_factor": rotary / head_dim,
                "moe_intermediate_size": key("expert_feed_forward_length")}
        shared_ff = key("expert_shared_feed_forward_length")
        if shared_ff is not None and raw["moe_intermediate_size"] is not None and \
                shared_ff != raw["n_shared_experts"] * raw["moe_intermediate_size"]:
            raise refuse(f"expert_shared_feed_forward_length {shared_ff} is not "
                         "expert_shared_count experts of expert_feed_forward_length")
    else:
        if key("expert_shared_count") or any("_shexp." in n for n in names):
            raise refuse("shared experts (this architecture has none)")
        if (key("expert_group_count") or 1) > 1:
            raise refuse(f"expert_group_count {key('expert_group_count')} (group-limited "
                         "routing is GLM's)")
        if hf_arch == "MixtralForCausalLM":
            if dense:
                raise refuse(f"layers {dense} have no experts")
            raw["num_local_experts"] = experts
        else:
            raw |= {"num_experts": experts, "mlp_only_layers": dense,
                    "moe_intermediate_size": key("expert_feed_forward_length")}
    if "moe_intermediate_size" in raw and raw["moe_intermediate_size"] is None:
        raise refuse("metadata lacks expert_feed_forward_length")
    return raw


def unexpected(path: str, name: str) -> ModelError:
    """The error for a tensor nothing maps, naming llama.cpp's old per-expert layout."""
    if PER_EXPERT.fullmatch(name):
        return ModelError(f"{path}: tensor {name!r} is one expert's: llama.cpp's layout before "
                          "stacked experts (ffn_*_exps) is not supported; convert the model "
                          "again with a current convert_hf_to_gguf.py")
    return ModelError(f"{path}: unexpected tensor {name!r}")
