"""GGUF mixtures of experts (Qwen3-MoE, Mixtral, GLM-4.5): a file written as llama.cpp's
converter writes one (stacked experts, its metadata keys) loads into the same model as
its safetensors twin; variants the engine does not run are refused by name."""
from __future__ import annotations

import json
import numpy as np
import pytest
import torch

from engines.config import ModelError
from engines.kv.layout import KVLayout
from engines.kv.pool import KVPool
from engines.loader import load_model
from engines.runner import ModelRunner
from tests.unit.gguf_files import gguf_meta, quantized_close, write_gguf

pytest.importorskip("transformers", reason="transformers writes the random checkpoints")

# Hugging Face variant (tests/unit/hf_models.py) -> llama.cpp's architecture
ARCH = {"qwen3_moe": "qwen3moe", "mixtral": "llama", "glm4_moe": "glm4moe"}


def _checkpoint(kind: str, root):
    from safetensors.torch import load_file
    from tests.unit.hf_models import make_checkpoint
    path = make_checkpoint(kind, root)
    state = {}
    for f in sorted(path.glob("*.safetensors")):
        state |= load_file(f)
    return path, json.loads((path / "config.json").read_text()), state


@pytest.fixture(scope="module", params=sorted(ARCH))
def twins(request, tmp_path_factory):
    """(safetensors directory, its GGUF file, HF config, state) of one architecture."""
    root = tmp_path_factory.mktemp(request.param)
    path, cfg, state = _checkpoint(request.param, root)
    return path, write_gguf(root / "m.gguf", cfg, state, arch=ARCH[request.param]), cfg, state


def run_greedy(model, prompt: list[int], steps: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens after `prompt` and the logits of the prefill and every decode step."""
    pool = KVPool(KVLayout.for_model(model.cfg, 16, model.dtype), 8, model.dtype, model.device)
    runner = ModelRunner(model, pool)
    table = pool.allocator.alloc(pool.pages_for(len(prompt) + steps))
    logits, seq = [runner.prefill([prompt], [table])[0]], list(prompt)
    for _ in range(steps):
        seq.append(int(logits[-1].argmax()))
        logits.append(runner.decode([seq[-1]], [len(seq) - 1], [table])[0])
    return seq[len(prompt):], logits


@torch.inference_mode()
def test_a_gguf_mixture_is_its_checkpoint(twins):
    """Same config (architecture, experts, router, dense layers, partial rotary), same
    parameters bit for bit, same logits and greedy tokens in float32."""
    ckpt, gguf, _, _ = twins
    ours, ref = load_model(str(gguf)), load_model(str(ckpt))
    assert ours.cfg.shape() == ref.cfg.shape() and ours.cfg.moe is not None
    theirs = dict(ref.net.named_parameters())
    for name, p in ours.net.named_parameters():
        assert torch.equal(p, theirs[name]), name
    prompt = [5, 77, 123, 9, 250, 31, 64]
    tokens, logits = run_greedy(ours, prompt, 8)
    want_tokens, want_logits = run_greedy(ref, prompt, 8)
    assert tokens == want_tokens
    for a, b in zip(logits, want_logits):
        assert torch.equal(a, b)


def test_the_metadata_is_llama_cpps(twins):
    ckpt, gguf, cfg, _ = twins
    meta = gguf_meta(gguf)
    arch = meta["general.architecture"]
    assert meta[f"{arch}.expert_used_count"] == cfg["num_experts_per_tok"]
    assert "blk.0.ffn_gate_exps.weight" in {t.name for t in _infos(gguf)} or arch == "glm4moe"
    if arch == "glm4moe":        # its MTP block follows the layers: one more block, skipped
        assert meta["glm4moe.block_count"] == cfg["num_hidden_layers"] + 1
        assert meta["glm4moe.rope.dimension_count"] == 8
        assert load_model(str(gguf)).cfg.rotary_dim == 8


def _infos(path):
    from engines.formats.gguf_header import read_header
    return read_header(path).tensors


def test_quantized_experts_are_read_expert_by_expert(tmp_path):
    """Q8_0 stacks: each expert dequantized from its own bytes equals the whole
    stack dequantized (within quantization's error of the checkpoint)."""
    path, cfg, state = _checkpoint("qwen3_moe", tmp_path)
    model = load_model(str(write_gguf(tmp_path / "q.gguf", cfg, state, "Q8_0", arch="qwen3moe")))
    for e in (0, 5, 7):
        gate_up, down = model.net.model.layers[0].mlp.experts.expert(e)
        want = torch.cat([state[f"model.layers.0.mlp.experts.{e}.{p}.weight"] for p in ("gate_proj", "up_proj")])
        assert quantized_close(gate_up.numpy(), want.numpy(), 1e-2)
        assert quantized_close(down.numpy(), state[f"model.layers.0.mlp.experts.{e}.down_proj.weight"].numpy(), 1e-2)
        assert not torch.equal(gate_up, want)       # it was quantized


# --- variants refused by name --------------------------------------------------------


def test_old_per_expert_layout_is_named(tmp_path):
    from tests.unit.gguf_files import write_tiny_gguf
    extra = {"blk.0.ffn_gate.0.weight": (np.zeros((128, 64), np.float32), "F32")}
    path = write_tiny_gguf(tmp_path / "old.gguf", extra=extra)
    with pytest.raises(ModelError, match=r"'blk.0.ffn_gate.0.weight' is one expert's: llama.cpp's "
                                         r"layout before stacked experts"):
        load_model(str(path))


@pytest.mark.parametrize("kind,meta,error", [
    ("glm4_moe", {"glm4moe.expert_gating_func": 1},
     r"\(Glm4MoeForCausalLM\): expert_gating_func 1 \(softmax\); this architecture's router is sigmoid"),
    ("glm4_moe", {"glm4moe.leading_dense_block_count": 2},
     r"dense layers \[0\] are not the first leading_dense_block_count \(2\) layers"),
    ("glm4_moe", {"glm4moe.rope.dimension_count": 7}, r"rope.dimension_count 7 of a head of 16"),
    ("qwen3_moe", {"qwen3moe.expert_group_count": 4}, r"\(Qwen3MoeForCausalLM\): expert_group_count 4"),
    ("qwen3_moe", {"qwen3moe.expert_shared_count": 1}, r"shared experts \(this architecture has none\)"),
    ("mixtral", {"llama.expert_gating_func": 2}, r"\(MixtralForCausalLM\): expert_gating_func 2 \(sigmoid\)"),
])
def test_unsupported_variants_are_named(tmp_path, kind, meta, error):
    _, cfg, state = _checkpoint(kind, tmp_path)
    path = write_gguf(tmp_path / "m.gguf", cfg, state, arch=ARCH[kind], meta=meta)
    with pytest.raises(ModelError, match=f"{path}: unsupported GGUF mixture of experts .*{error}"):
        load_model(str(path))


def test_a_stack_that_is_not_three_dimensional_is_named(tmp_path):
    _, cfg, state = _checkpoint("qwen3_moe", tmp_path)
    extra = {"blk.0.ffn_up_exps.weight": (np.zeros((256, 64), np.float32), "F32")}
    path = write_gguf(tmp_path / "m.gguf", cfg, state, arch="qwen3moe", extra=extra)
    with pytest.raises(ModelError, match=r"m.gguf: tensor 'blk.0.ffn_up_exps.weight' has shape "
                                         r"\[256, 64\]; stacked experts are \[experts, rows, cols\]"):
        load_model(str(path))


def test_a_mixtral_without_expert_tensors_in_a_layer_is_named(tmp_path):
    _, cfg, state = _checkpoint("mixtral", tmp_path)
    state = {n: t for n, t in state.items() if "layers.2.block_sparse_moe" not in n}
    path = write_gguf(tmp_path / "m.gguf", cfg, state, arch="llama")
    with pytest.raises(ModelError, match=r"\(MixtralForCausalLM\): layers \[2\] have no experts"):
        load_model(str(path))


def test_an_update_to_other_expert_counts_is_refused(tmp_path):
    """update_weights from disk compares the whole shape, experts included; a GGUF file
    of the same shape updates a model loaded from safetensors."""
    from engines.loader import update_weights
    from tests.unit.hf_models import make_checkpoint
    model = load_model(str(make_checkpoint("mixtral", tmp_path, seed=1)), dtype="float64")
    path, cfg, state = _checkpoint("mixtral", tmp_path)          # seed 0
    assert update_weights(model, str(write_gguf(tmp_path / "s0.gguf", cfg, state)), "g0") == "g0"
    want = dict(load_model(str(path), dtype="float64").net.named_parameters())
    assert all(torch.equal(p, want[n]) for n, p in model.net.named_parameters())
    other = make_checkpoint("mixtral", tmp_path, seed=2, num_local_experts=8)
    with pytest.raises(ModelError, match="architecture differs from the loaded model.*'num_experts': 8"):
        update_weights(model, str(other))
    assert all(torch.equal(p, want[n]) for n, p in model.net.named_parameters())
    assert model.version == "g0"
