"""The embedded default model: a small Llama built from a seed, with a byte tokenizer.

`tiny` is seed 0; `tiny:N` is seed N (handy as a second checkpoint for weight updates).
`save_tiny` writes the same model as an ordinary Hugging Face directory.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from engines.formats.tokenizer import Tokenizer, byte_tokenizer

if TYPE_CHECKING:
    import torch

# torch is imported only where weights are made: the HTTP front takes the config and
# tokenizer from here without it (tests/unit/test_router_no_torch.py)

BOS_ID, EOS_ID = 256, 257

TINY_CONFIG: dict = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 258,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
    "hidden_act": "silu",
}


def is_tiny(spec: str) -> bool:
    return spec == "tiny" or spec.startswith("tiny:")


def tiny_seed(spec: str) -> int:
    if spec == "tiny":
        return 0
    try:
        return int(spec.split(":", 1)[1])
    except ValueError:
        raise ValueError(f"bad tiny model spec {spec!r}: expected 'tiny' or 'tiny:SEED'") from None


def tiny_state_dict(seed: int, config: dict = TINY_CONFIG) -> dict[str, torch.Tensor]:
    """Weights in Hugging Face naming, from `seed` alone (CPU generator, float32), of
    the tiny model or of another Llama `config` with its byte vocabulary.

    The scale is large enough that logits are peaked, so greedy decoding has clear
    winners instead of near-ties that would make outputs fragile across dtypes."""
    import torch

    c, g = config, torch.Generator().manual_seed(seed)
    h, inter, d = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    hq, hkv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d

    def rand(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    embed, head = rand(c["vocab_size"], h, std=1.0), rand(c["vocab_size"], h, std=0.5)
    # Hidden dimension 0 carries a constant that lm_head turns into a bias towards
    # printable ASCII, so the demo prints characters rather than stray bytes.
    embed[:, 0] = 4.0
    head[:, 0] = -2.0
    head[32:127, 0] = 2.0
    sd = {"model.embed_tokens.weight": embed,
          "model.norm.weight": 1.0 + rand(h, std=0.1),
          "lm_head.weight": head}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        sd |= {p + "input_layernorm.weight": 1.0 + rand(h, std=0.1),
               p + "post_attention_layernorm.weight": 1.0 + rand(h, std=0.1),
               p + "self_attn.q_proj.weight": rand(hq, h, std=h ** -0.5),
               p + "self_attn.k_proj.weight": rand(hkv, h, std=h ** -0.5),
               p + "self_attn.v_proj.weight": rand(hkv, h, std=h ** -0.5),
               p + "self_attn.o_proj.weight": rand(h, hq, std=hq ** -0.5),
               p + "mlp.gate_proj.weight": rand(inter, h, std=h ** -0.5),
               p + "mlp.up_proj.weight": rand(inter, h, std=h ** -0.5),
               p + "mlp.down_proj.weight": rand(h, inter, std=inter ** -0.5)}
    return sd


def tiny_tokenizer() -> Tokenizer:
    return byte_tokenizer(BOS_ID, EOS_ID)


def save_tiny(path: str | Path, seed: int = 0, config: dict = TINY_CONFIG) -> Path:
    """Write tiny:`seed` as a Hugging Face-format directory (config, weights, tokenizer);
    with `config` (TINY_CONFIG | changes), another shape of it."""
    from safetensors.torch import save_file

    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tiny_state_dict(seed, config), str(root / "model.safetensors"))
    (root / "tokenizer.json").write_text(tiny_tokenizer().to_json())
    return root
