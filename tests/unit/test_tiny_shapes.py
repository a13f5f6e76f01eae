"""save_tiny with another config (bench_score.py --model deep): the directory loads as
that shape, and the default one is still the embedded tiny model."""
from __future__ import annotations

import torch

from engines.loader import load_model
from engines.models.tiny import TINY_CONFIG, save_tiny, tiny_state_dict

DEEPER = TINY_CONFIG | {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 3,
                        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16}


def test_save_tiny_writes_the_config_it_is_given(tmp_path):
    model = load_model(str(save_tiny(tmp_path / "deeper", seed=4, config=DEEPER)), dtype="float32")
    cfg = model.cfg
    assert (cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads,
            cfg.vocab_size) == (3, 32, 48, 2, 1, 258)
    weights = tiny_state_dict(4, DEEPER)
    assert weights["model.layers.2.mlp.down_proj.weight"].shape == (32, 48)
    assert torch.equal(model.net.lm_head.weight, weights["lm_head.weight"])


def test_save_tiny_by_default_is_the_embedded_model(tmp_path):
    saved = load_model(str(save_tiny(tmp_path / "t", seed=2)), dtype="float32")
    embedded = load_model("tiny:2", dtype="float32")
    assert saved.cfg == embedded.cfg
    assert torch.equal(saved.net.lm_head.weight, embedded.net.lm_head.weight)
